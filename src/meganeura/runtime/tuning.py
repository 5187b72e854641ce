"""Timing one kernel configuration on the device for the tuner (compile/tune.py): scratch
buffers of the kernel's binding sizes, a warm-up, then many dispatches back to back.

The tuner decides what to time; this only executes a finished ``KernelSpec``."""

from __future__ import annotations

import time

from ..errors import MeganeuraError

REPEATS = 20
WARMUP_SECONDS = 0.3  # an idle GPU runs at a fraction of its clock (see profile.py)


class KernelTimer:
    """``timer(spec, sizes) -> seconds per dispatch`` on ``dev`` (inf when the configuration
    does not compile or run there: the tuner then skips it)."""

    def __init__(self, dev):
        self.dev = dev
        self._warm = False
        self._scratch: dict[int, object] = {}

    def __call__(self, spec, sizes: list[int]) -> float:
        try:
            pipeline = self.dev.pipeline(spec)
            bind_group = self._bind_group(spec, sizes)
        except (MeganeuraError, RuntimeError, ValueError):  # not valid on this device
            return float("inf")
        if not self._warm:
            self._busy(pipeline, bind_group, spec.workgroups, WARMUP_SECONDS)
            self._warm = True
        self._run(pipeline, bind_group, spec.workgroups, 3)
        t0 = time.perf_counter()
        self._run(pipeline, bind_group, spec.workgroups, REPEATS)
        return (time.perf_counter() - t0) / REPEATS

    def _bind_group(self, spec, sizes: list[int]):
        """Distinct scratch buffers per slot (contents irrelevant for speed; zeros)."""
        import wgpu

        layout = self.dev.bind_group_layout(spec.n_bindings)[0]
        entries = []
        for i, n in enumerate(sizes):
            n4 = max(-(-int(n) // 4) * 4, 4)
            key = (i, n4)
            if key not in self._scratch:
                self._scratch[key] = self.dev.device.create_buffer(
                    size=n4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
            entries.append({"binding": i, "resource": {"buffer": self._scratch[key],
                                                       "offset": 0, "size": n4}})
        return self.dev.device.create_bind_group(layout=layout, entries=entries)

    def _run(self, pipeline, bind_group, workgroups, n: int) -> None:
        enc = self.dev.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipeline)
        cp.set_bind_group(0, bind_group)
        for _ in range(n):
            cp.dispatch_workgroups(*workgroups)
        cp.end()
        self.dev.queue.submit([enc.finish()])
        self.dev.sync()

    def _busy(self, pipeline, bind_group, workgroups, seconds: float) -> None:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            self._run(pipeline, bind_group, workgroups, 10)


def device_key(dev) -> str:
    """What a tuning result is valid for: implementation, adapter and driver."""
    info = dev.describe()
    return f"{dev.implementation}|{dev.adapter_name}|{info.get('description', '')}"
