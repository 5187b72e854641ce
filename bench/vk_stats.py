"""What the Vulkan driver made of a SPIR-V compute shader: registers, spills, shared memory and
(where the driver gives one) its machine code, through ``VK_KHR_pipeline_executable_properties``.

WebGPU hides this: Dawn compiles our WGSL to SPIR-V and hands it to the driver, whose register
allocation decides whether a big tensor-core tile runs at 219 or 95 TFLOP/s (docs/benchmarks.md).
This module makes its own Vulkan device (plain ``ctypes`` on ``libvulkan.so.1``; no Dawn), creates
the same compute pipeline with ``CAPTURE_STATISTICS`` and returns the driver's statistics.
``bench/pipeline_stats.py`` feeds it Dawn's own SPIR-V."""

from __future__ import annotations

import ctypes as C
import struct

VK_API_1_3 = (1 << 22) | (3 << 12)
ST_APP, ST_INSTANCE, ST_QUEUE, ST_DEVICE = 0, 1, 2, 3
ST_SHADER_MODULE, ST_STAGE, ST_COMPUTE_PIPELINE = 16, 18, 29
ST_PIPELINE_LAYOUT, ST_SET_LAYOUT = 30, 32
ST_FEATURES2, ST_VK11, ST_VK12, ST_VK13 = 1000059000, 49, 51, 53
ST_COOPMAT_FEATURES, ST_EXEC_FEATURES = 1000506000, 1000269000
ST_PIPELINE_INFO, ST_EXEC_PROPS, ST_EXEC_INFO = 1000269001, 1000269002, 1000269003
ST_EXEC_STAT, ST_EXEC_IR = 1000269004, 1000269005
CAPTURE_STATISTICS, CAPTURE_IR = 0x40, 0x80
STAGE_COMPUTE, DESC_UNIFORM, DESC_STORAGE = 0x20, 6, 7
P = C.c_void_p


class VkError(RuntimeError):
    """A Vulkan call failed (its VkResult in the message)."""



def _struct(name, fields):
    return type(name, (C.Structure,), {"_fields_": fields})


AppInfo = _struct("AppInfo", [("sType", C.c_int), ("pNext", P), ("app", C.c_char_p),
                              ("appv", C.c_uint32), ("eng", C.c_char_p), ("engv", C.c_uint32),
                              ("api", C.c_uint32)])
InstanceInfo = _struct("InstanceInfo", [
    ("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32), ("app", C.POINTER(AppInfo)),
    ("nlayers", C.c_uint32), ("layers", P), ("next", C.c_uint32), ("exts", P)])
QueueInfo = _struct("QueueInfo", [("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32),
                                  ("family", C.c_uint32), ("count", C.c_uint32),
                                  ("prio", C.POINTER(C.c_float))])
DeviceInfo = _struct("DeviceInfo", [
    ("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32), ("nqueues", C.c_uint32),
    ("queues", C.POINTER(QueueInfo)), ("nlayers", C.c_uint32), ("layers", P),
    ("next", C.c_uint32), ("exts", C.POINTER(C.c_char_p)), ("features", P)])
ModuleInfo = _struct("ModuleInfo", [("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32),
                                    ("size", C.c_size_t), ("code", P)])
Binding = _struct("Binding", [("binding", C.c_uint32), ("type", C.c_int),
                              ("count", C.c_uint32), ("stages", C.c_uint32), ("samplers", P)])
SetLayoutInfo = _struct("SetLayoutInfo", [("sType", C.c_int), ("pNext", P),
                                          ("flags", C.c_uint32), ("n", C.c_uint32),
                                          ("bindings", C.POINTER(Binding))])
PushRange = _struct("PushRange", [("stages", C.c_uint32), ("offset", C.c_uint32),
                                  ("size", C.c_uint32)])
LayoutInfo = _struct("LayoutInfo", [
    ("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32), ("nsets", C.c_uint32),
    ("sets", C.POINTER(C.c_uint64)), ("npush", C.c_uint32), ("push", C.POINTER(PushRange))])
StageInfo = _struct("StageInfo", [("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32),
                                  ("stage", C.c_uint32), ("module", C.c_uint64),
                                  ("name", C.c_char_p), ("spec", P)])
PipelineInfo = _struct("PipelineInfo", [
    ("sType", C.c_int), ("pNext", P), ("flags", C.c_uint32), ("stage", StageInfo),
    ("layout", C.c_uint64), ("base", C.c_uint64), ("base_index", C.c_int32)])
PipeRef = _struct("PipeRef", [("sType", C.c_int), ("pNext", P), ("pipeline", C.c_uint64)])
ExecRef = _struct("ExecRef", [("sType", C.c_int), ("pNext", P), ("pipeline", C.c_uint64),
                              ("index", C.c_uint32)])
ExecProps = _struct("ExecProps", [("sType", C.c_int), ("pNext", P), ("stages", C.c_uint32),
                                  ("name", C.c_char * 256), ("desc", C.c_char * 256),
                                  ("subgroup", C.c_uint32)])
Stat = _struct("Stat", [("sType", C.c_int), ("pNext", P), ("name", C.c_char * 256),
                        ("desc", C.c_char * 256), ("format", C.c_int), ("value", C.c_uint64)])
IR = _struct("IR", [("sType", C.c_int), ("pNext", P), ("name", C.c_char * 256),
                    ("desc", C.c_char * 256), ("text", C.c_uint32), ("size", C.c_size_t),
                    ("data", P)])


def _check(res: int, what: str) -> None:
    if res != 0:
        raise VkError(f"{what} failed: VkResult {res}")


def _chain(stypes) -> tuple[list, int]:
    """Zeroed feature structs (generously sized) linked by pNext; (buffers, address of head)."""
    bufs = [C.create_string_buffer(2048) for _ in stypes]
    for i, (b, st) in enumerate(zip(bufs, stypes, strict=True)):
        nxt = C.addressof(bufs[i + 1]) if i + 1 < len(bufs) else 0
        b[0:16] = struct.pack("<iiQ", st, 0, nxt)
    return bufs, C.addressof(bufs[0])


def spirv_bindings(code: bytes) -> tuple[list[tuple[int, int, int]], bool]:
    """([(set, binding, descriptor type)], uses push constants) of a SPIR-V module."""
    words = struct.unpack(f"<{len(code) // 4}I", code)
    deco: dict[int, dict[int, int]] = {}
    storage: dict[int, int] = {}
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 71 and words[i + 2] in (33, 34):  # OpDecorate Binding / DescriptorSet
            deco.setdefault(words[i + 1], {})[words[i + 2]] = words[i + 3]
        elif op == 59:  # OpVariable: type, id, storage class
            storage[words[i + 2]] = words[i + 3]
        i += max(n, 1)
    out = [(d.get(34, 0), d[33], DESC_UNIFORM if storage.get(v) == 2 else DESC_STORAGE)
           for v, d in deco.items() if 33 in d]
    return sorted(out), 9 in storage.values()


class VulkanStats:
    """A Vulkan device that captures pipeline statistics (the first GPU with the extension)."""

    def __init__(self, lib: str = "libvulkan.so.1") -> None:
        self.vk = C.CDLL(lib)
        self._instance()
        self._device()

    def _fn(self, name: str, *argtypes):
        f = C.CFUNCTYPE(C.c_int, *argtypes)(self.vk.vkGetDeviceProcAddr(
            C.c_void_p(self.device), name.encode()))
        return f

    def _instance(self) -> None:
        self.vk.vkGetDeviceProcAddr.restype = P
        self.vk.vkGetDeviceProcAddr.argtypes = [P, C.c_char_p]
        app = AppInfo(ST_APP, None, b"meganeura-vk-stats", 1, b"meganeura", 1, VK_API_1_3)
        info = InstanceInfo(ST_INSTANCE, None, 0, C.pointer(app), 0, None, 0, None)
        inst = P()
        _check(self.vk.vkCreateInstance(C.byref(info), None, C.byref(inst)), "vkCreateInstance")
        self.instance = inst.value
        n = C.c_uint32()
        self.vk.vkEnumeratePhysicalDevices(P(self.instance), C.byref(n), None)
        devs = (P * n.value)()
        self.vk.vkEnumeratePhysicalDevices(P(self.instance), C.byref(n), devs)
        if not n.value:
            raise VkError("no Vulkan device")
        with_stats = [d for d in devs
                      if "VK_KHR_pipeline_executable_properties" in self._extensions(d)]
        self.has_stats = bool(with_stats)  # without: pipelines only (tests on lavapipe)
        self.physical = (with_stats or list(devs))[0]
        props = C.create_string_buffer(4096)
        self.vk.vkGetPhysicalDeviceProperties(P(self.physical), props)
        self.name = props.raw[20:276].split(b"\0")[0].decode()

    def _extensions(self, d) -> set[str]:
        n = C.c_uint32()
        self.vk.vkEnumerateDeviceExtensionProperties(P(d), None, C.byref(n), None)
        buf = C.create_string_buffer(260 * n.value)
        self.vk.vkEnumerateDeviceExtensionProperties(P(d), None, C.byref(n), buf)
        return {buf.raw[260 * i:260 * i + 256].split(b"\0")[0].decode() for i in range(n.value)}

    def _device(self) -> None:
        """Every feature the GPU has (features2 chain filled by the driver, then passed back)."""
        have = self._extensions(self.physical)
        want = [e for e in ("VK_KHR_pipeline_executable_properties", "VK_KHR_cooperative_matrix",
                            "VK_KHR_shader_float16_int8", "VK_KHR_16bit_storage",
                            "VK_KHR_vulkan_memory_model", "VK_EXT_subgroup_size_control",
                            "VK_KHR_shader_subgroup_uniform_control_flow") if e in have]
        stypes = [ST_FEATURES2, ST_VK11, ST_VK12, ST_VK13] + (
            [ST_EXEC_FEATURES] if self.has_stats else [])
        if "VK_KHR_cooperative_matrix" in want:
            stypes.append(ST_COOPMAT_FEATURES)
        self._feat, head = _chain(stypes)
        self.vk.vkGetPhysicalDeviceFeatures2(P(self.physical), P(head))
        prio = C.c_float(1.0)
        q = QueueInfo(ST_QUEUE, None, 0, 0, 1, C.pointer(prio))
        exts = (C.c_char_p * len(want))(*[e.encode() for e in want])
        info = DeviceInfo(ST_DEVICE, P(head), 0, 1, C.pointer(q), 0, None, len(want), exts, None)
        dev = P()
        _check(self.vk.vkCreateDevice(P(self.physical), C.byref(info), None, C.byref(dev)),
               "vkCreateDevice")
        self.device = dev.value
        self.extensions = want

    def _layout(self, code: bytes) -> int:
        binds, push = spirv_bindings(code)
        sets = sorted({s for s, _, _ in binds}) or [0]
        handles = (C.c_uint64 * (max(sets) + 1))()
        for s in range(max(sets) + 1):
            mine = [b for b in binds if b[0] == s]
            arr = (Binding * max(1, len(mine)))(*[Binding(b, t, 1, STAGE_COMPUTE, None)
                                                  for _, b, t in mine])
            info = SetLayoutInfo(ST_SET_LAYOUT, None, 0, len(mine), arr)
            h = C.c_uint64()
            _check(self.vk.vkCreateDescriptorSetLayout(P(self.device), C.byref(info), None,
                                                       C.byref(h)), "vkCreateDescriptorSetLayout")
            handles[s] = h.value
        pr = PushRange(STAGE_COMPUTE, 0, 128)
        info = LayoutInfo(ST_PIPELINE_LAYOUT, None, 0, max(sets) + 1, handles, int(push),
                          C.pointer(pr))
        h = C.c_uint64()
        _check(self.vk.vkCreatePipelineLayout(P(self.device), C.byref(info), None, C.byref(h)),
               "vkCreatePipelineLayout")
        return h.value

    def pipeline(self, code: bytes, entry: str = "main", ir: bool = True) -> int:
        """A compute pipeline of SPIR-V ``code`` created with statistics captured."""
        buf = C.create_string_buffer(code, len(code))
        mi = ModuleInfo(ST_SHADER_MODULE, None, 0, len(code), C.cast(buf, P))
        mod = C.c_uint64()
        _check(self.vk.vkCreateShaderModule(P(self.device), C.byref(mi), None, C.byref(mod)),
               "vkCreateShaderModule")
        st = StageInfo(ST_STAGE, None, 0, STAGE_COMPUTE, mod.value, entry.encode(), None)
        flags = (CAPTURE_STATISTICS | (CAPTURE_IR if ir else 0)) if self.has_stats else 0
        info = PipelineInfo(ST_COMPUTE_PIPELINE, None, flags, st, self._layout(code), 0, -1)
        pipe = C.c_uint64()
        _check(self.vk.vkCreateComputePipelines(P(self.device), C.c_uint64(0), 1, C.byref(info),
                                                None, C.byref(pipe)), "vkCreateComputePipelines")
        return pipe.value

    def statistics(self, pipe: int) -> dict[str, float]:
        """The driver's statistics of the pipeline's (first) executable, by name ({} when
        the device has no ``VK_KHR_pipeline_executable_properties``)."""
        if not self.has_stats:
            return {}
        get = self._fn("vkGetPipelineExecutableStatisticsKHR", P, C.POINTER(ExecRef),
                       C.POINTER(C.c_uint32), C.POINTER(Stat))
        ref = ExecRef(ST_EXEC_INFO, None, pipe, 0)
        n = C.c_uint32()
        _check(get(P(self.device), C.byref(ref), C.byref(n), None), "statistics count")
        arr = (Stat * n.value)(*[Stat(ST_EXEC_STAT) for _ in range(n.value)])
        _check(get(P(self.device), C.byref(ref), C.byref(n), arr), "statistics")
        out = {}
        for s in arr:
            raw = struct.pack("<Q", s.value)
            val = {0: lambda r: float(struct.unpack("<I", r[:4])[0]),
                   1: lambda r: float(struct.unpack("<q", r)[0]),
                   2: lambda r: float(struct.unpack("<Q", r)[0]),
                   3: lambda r: struct.unpack("<d", r)[0]}[s.format](raw)
            out[s.name.decode()] = val
        return out

    def internal(self, pipe: int) -> dict[str, str]:
        """The driver's internal representations (text ones), by name; {} when it gives none."""
        if not self.has_stats:
            return {}
        get = self._fn("vkGetPipelineExecutableInternalRepresentationsKHR", P,
                       C.POINTER(ExecRef), C.POINTER(C.c_uint32), C.POINTER(IR))
        ref = ExecRef(ST_EXEC_INFO, None, pipe, 0)
        n = C.c_uint32()
        if get(P(self.device), C.byref(ref), C.byref(n), None) != 0 or not n.value:
            return {}
        arr = (IR * n.value)(*[IR(ST_EXEC_IR) for _ in range(n.value)])
        get(P(self.device), C.byref(ref), C.byref(n), arr)
        bufs = [C.create_string_buffer(max(1, r.size)) for r in arr]
        for r, b in zip(arr, bufs, strict=True):
            r.data = C.cast(b, P)
        get(P(self.device), C.byref(ref), C.byref(n), arr)
        return {r.name.decode(): (b.raw[:r.size].rstrip(b"\0").decode(errors="replace")
                                  if r.text else f"<{r.size} bytes of binary>")
                for r, b in zip(arr, bufs, strict=True)}
