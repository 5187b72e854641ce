// meganeura.js: run a program exported by meganeura (`session.export(path)`, `meganeura export`)
// in a web page through WebGPU.  A dependency-free ES module:
//
//   import { loadProgram } from "./meganeura.js";
//   const program = await loadProgram("mlp/");            // the artifact folder's URL
//   const { logits } = await program.run({ x: new Float32Array(64) });
//   const { __loss__ } = await program.step({ x, y });    // artifacts of training programs
//
// The artifact (runtime/artifact.py, compile/executable.py) is the compiled plan itself:
// buffers, WGSL modules, and per stream a fixed list of dispatches and copies with byte ranges.
// This file executes that plan and nothing else: no graph, no kernels of its own.  Everything
// is built once at load (buffers, pipelines, one bind group per dispatch), so a run is: write
// the feeds, encode the stream into one command buffer, copy the fetched results to a
// MAP_READ buffer, read them back.  Every problem is an Error whose message says what is wrong
// with which file or limit, for showing in the page as it is.

export const FORMAT = "meganeura-executable";
export const VERSION = 1;

/** The artifact is missing, corrupt or of another format version. */
export class ArtifactError extends Error {
  constructor(message) { super(message); this.name = "ArtifactError"; }
}

/** This browser's WebGPU adapter lacks a limit or feature the program needs. */
export class DeviceError extends Error {
  constructor(message) { super(message); this.name = "DeviceError"; }
}

/** A feed has the wrong name, length, type or values. */
export class FeedError extends Error {
  constructor(message) { super(message); this.name = "FeedError"; }
}

// dtype name -> bytes in safetensors, bytes on the GPU (bool is u32 there), the typed array
// that holds one in JS (f16 as raw halves), safetensors' name
const DTYPES = {
  f32: { bytes: 4, gpuBytes: 4, array: Float32Array, st: "F32" },
  f16: { bytes: 2, gpuBytes: 2, array: Uint16Array, st: "F16" },
  i32: { bytes: 4, gpuBytes: 4, array: Int32Array, st: "I32" },
  u32: { bytes: 4, gpuBytes: 4, array: Uint32Array, st: "U32" },
  bool: { bytes: 1, gpuBytes: 4, array: Uint8Array, st: "BOOL" },
};

// WebGPU's guaranteed limits: a device gets these unless it asks for more
const DEFAULT_LIMITS = {
  maxStorageBufferBindingSize: 134217728,
  maxBufferSize: 268435456,
  maxStorageBuffersPerShaderStage: 8,
  maxComputeWorkgroupStorageSize: 16384,
  maxComputeInvocationsPerWorkgroup: 256,
  maxComputeWorkgroupSizeX: 256,
  maxComputeWorkgroupSizeY: 256,
  maxComputeWorkgroupSizeZ: 64,
  maxComputeWorkgroupsPerDimension: 65535,
};

// WGSL `enable` directives -> the WebGPU feature each needs
const ENABLES = {
  f16: "shader-f16",
  subgroups: "subgroups",
  chromium_experimental_subgroup_matrix: "chromium-experimental-subgroup-matrix",
};

const round4 = (n) => Math.ceil(n / 4) * 4;
const product = (shape) => shape.reduce((a, b) => a * b, 1);
const squeeze = (shape) => shape.filter((d) => d !== 1).join(",");
const fmtType = (t) => `${t.dtype}[${t.shape.join(", ")}]`;

/**
 * Fetch an artifact folder and build it on a WebGPU device.
 * @param {string} url  the folder (`.../mlp` or `.../mlp/`), relative to the page or absolute
 * @param {{device?: GPUDevice, fetch?: Function}} options  an existing device to use instead of
 *   requesting one (it must already have the limits and features the program needs)
 * @returns {Promise<Program>}
 */
export async function loadProgram(url, options = {}) {
  const t0 = performance.now();
  const base = new URL(String(url).replace(/\/?$/, "/"), globalThis.location?.href).href;
  const get = options.fetch ?? globalThis.fetch.bind(globalThis);
  const manifest = checkManifest(await fetchFile(get, base, "manifest.json", "json"), base);
  const nModules = 1 + Math.max(-1, ...dispatches(manifest).map((op) => op.module));
  const names = Array.from({ length: nModules }, (_, i) => kernelFile(i));
  const [modules, weightsBuf] = await Promise.all([
    Promise.all(names.map((n) => fetchFile(get, base, n, "text"))),
    fetchFile(get, base, "weights.safetensors", "arrayBuffer"),
  ]);
  const weights = checkWeights(manifest, parseSafetensors(weightsBuf, base), base);
  const t1 = performance.now();
  const needs = requirements(manifest, modules);
  const device = options.device ?? await openDevice(needs);
  if (options.device) checkDevice(options.device, needs, "the given device");
  const program = new Program(device, manifest, modules, weights, base);
  await program.build();
  program.timings = { fetchMs: t1 - t0, buildMs: performance.now() - t1,
                      bytes: weightsBuf.byteLength + modules.reduce((a, m) => a + m.length, 0) };
  return program;
}

// ------------------------------------------------------------------------------- artifact files

function kernelFile(i) {
  return `kernels/${String(i).padStart(3, "0")}.wgsl`;
}

async function fetchFile(get, base, name, as) {
  let resp;
  try {
    resp = await get(base + name);
  } catch (e) {
    throw new ArtifactError(`artifact ${base}: cannot fetch ${name} (${e.message})`);
  }
  if (!resp.ok) {
    const why = resp.status === 404 ? "is missing" : "could not be read";
    throw new ArtifactError(`artifact ${base}: ${name} ${why} (HTTP ${resp.status})`);
  }
  if (as !== "json") return resp[as]();
  const text = await resp.text();
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new ArtifactError(`artifact ${base}: ${name} is not valid JSON (${e.message})`);
  }
}

/** The manifest, after the checks that make everything below safe to index. */
function checkManifest(m, base) {
  const bad = (why) => new ArtifactError(`artifact ${base}: manifest.json ${why}`);
  if (m === null || typeof m !== "object" || m.format !== FORMAT) {
    throw bad(`is not a meganeura executable (format ${JSON.stringify(m?.format)}, ` +
              `expected "${FORMAT}")`);
  }
  if (m.version !== VERSION) {
    throw bad(`has format version ${JSON.stringify(m.version)}; this meganeura.js reads ` +
              `version ${VERSION} (export the program again with this release, or use the ` +
              `meganeura.js of the release that wrote it)`);
  }
  for (const key of ["leaves", "groups", "group_home", "streams", "program"]) {
    if (!(key in m)) throw bad(`lacks "${key}"`);
  }
  for (const [tag, s] of Object.entries(m.streams)) {
    if (!Array.isArray(s.ops) || !Array.isArray(s.fetch)) throw bad(`stream "${tag}" is malformed`);
  }
  for (const [name, leaf] of Object.entries(m.leaves)) {
    if (!(leaf.dtype in DTYPES)) throw bad(`gives '${name}' the unknown dtype "${leaf.dtype}"`);
  }
  return m;
}

function dispatches(manifest) {
  return Object.values(manifest.streams).flatMap((s) => s.ops.filter((op) => "module" in op));
}

/** safetensors: 8-byte little-endian header length, a JSON header, then the raw data. */
export function parseSafetensors(buf, where = "") {
  const bad = (why) => new ArtifactError(`artifact ${where}: weights.safetensors ${why}`);
  if (buf.byteLength < 8) throw bad(`is truncated (${buf.byteLength} bytes)`);
  const n = Number(new DataView(buf).getBigUint64(0, true));
  if (8 + n > buf.byteLength) {
    throw bad(`is truncated: its header claims ${n} bytes but the file has ${buf.byteLength}`);
  }
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 8, n)));
  } catch (e) {
    throw bad(`has a corrupt header (${e.message})`);
  }
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const [begin, end] = t.data_offsets;
    if (8 + n + end > buf.byteLength || begin > end) {
      throw bad(`is truncated: tensor '${name}' ends at byte ${8 + n + end} but the file has ` +
                `${buf.byteLength}`);
    }
    tensors[name] = { dtype: t.dtype, shape: t.shape, bytes: new Uint8Array(buf, 8 + n + begin,
                                                                             end - begin) };
  }
  return tensors;
}

/** The persistent tensors and constants, each present with the dtype and shape the program
 *  was compiled for (a weights file from another model or export fails here, by name). */
function checkWeights(manifest, tensors, base) {
  const needed = new Set(manifest.program.persistent);
  for (const [n, leaf] of Object.entries(manifest.leaves)) if (leaf.kind === "constant") needed.add(n);
  const out = {};
  const halves = new Set(manifest.program.stored_f16 ?? []);
  for (const name of needed) {
    const leaf = manifest.leaves[name];
    let t = tensors[name];
    const where = `artifact ${base}: weights.safetensors`;
    if (!t) throw new ArtifactError(`${where} lacks '${name}' (${fmtType(leaf)})`);
    if (halves.has(name) && leaf.dtype === "f32" && t.dtype === "F16") t = halvesToF32(t);
    const dt = DTYPES[leaf.dtype];
    const sameShape = squeeze(t.shape) === squeeze(leaf.shape); // scalars may be saved as [1]
    if (t.dtype !== dt.st || !sameShape || t.bytes.byteLength !== product(leaf.shape) * dt.bytes) {
      throw new ArtifactError(`${where}: '${name}' is ${t.dtype}[${t.shape.join(", ")}] ` +
                              `(${t.bytes.byteLength} bytes); the program needs ${fmtType(leaf)}`);
    }
    out[name] = t.bytes;
  }
  return out;
}

/** An f16-stored parameter (export with weights="f16") as the f32 tensor the program reads:
 *  the download is halved, the GPU program and its results stay those of the f32 export. */
function halvesToF32(t) {
  const n = t.bytes.byteLength >> 1;
  const h = new DataView(t.bytes.buffer, t.bytes.byteOffset, t.bytes.byteLength);
  const f = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const v = h.getUint16(2 * i, true);
    const sign = v & 0x8000 ? -1 : 1, e = (v >> 10) & 0x1f, m = v & 0x3ff;
    f[i] = sign * (e === 0 ? m * 2 ** -24 : e === 31 ? (m ? NaN : Infinity)
                                                     : (1 + m / 1024) * 2 ** (e - 15));
  }
  return { dtype: "F32", shape: t.shape, bytes: new Uint8Array(f.buffer) };
}

// ------------------------------------------------------------------------------- device

/** What the program needs of a device: limits (WebGPU names) and features, from the manifest's
 *  buffers and bindings and from the WGSL modules' workgroup sizes, workgroup arrays and
 *  `enable` directives. */
export function requirements(manifest, modules) {
  const limits = { maxStorageBuffersPerShaderStage: 0, maxStorageBufferBindingSize: 0,
                   maxComputeWorkgroupsPerDimension: 0, maxBufferSize: 0 };
  let align = 256; // the largest power of two (up to 256) dividing every binding offset
  for (const op of dispatches(manifest)) {
    limits.maxStorageBuffersPerShaderStage = Math.max(limits.maxStorageBuffersPerShaderStage,
                                                      op.bindings.length);
    for (const [, , offset, nbytes] of op.bindings) {
      limits.maxStorageBufferBindingSize = Math.max(limits.maxStorageBufferBindingSize,
                                                    round4(nbytes));
      while (offset % align) align /= 2;
    }
    limits.maxComputeWorkgroupsPerDimension = Math.max(limits.maxComputeWorkgroupsPerDimension,
                                                       ...op.workgroups);
  }
  for (const size of bufferSizes(manifest).values()) {
    limits.maxBufferSize = Math.max(limits.maxBufferSize, size);
  }
  const features = new Set();
  for (const src of modules) Object.assign(limits, maxed(limits, shaderNeeds(src, features)));
  for (const leaf of Object.values(manifest.leaves)) {
    if (leaf.dtype === "f16") features.add("shader-f16");
  }
  return { limits, features, align };
}

function maxed(a, b) {
  const out = {};
  for (const [k, v] of Object.entries(b)) out[k] = Math.max(a[k] ?? 0, v);
  return out;
}

/** Workgroup size and workgroup storage of one WGSL module (its largest entry point; all
 *  module-scope workgroup arrays counted), and the features its `enable`s need. */
function shaderNeeds(src, features) {
  const out = { maxComputeInvocationsPerWorkgroup: 0, maxComputeWorkgroupSizeX: 0,
                maxComputeWorkgroupSizeY: 0, maxComputeWorkgroupSizeZ: 0,
                maxComputeWorkgroupStorageSize: 0 };
  for (const m of src.matchAll(/@workgroup_size\(([^)]*)\)/g)) {
    const [x = 1, y = 1, z = 1] = m[1].split(",").map((s) => parseInt(s, 10));
    out.maxComputeInvocationsPerWorkgroup = Math.max(out.maxComputeInvocationsPerWorkgroup, x * y * z);
    out.maxComputeWorkgroupSizeX = Math.max(out.maxComputeWorkgroupSizeX, x);
    out.maxComputeWorkgroupSizeY = Math.max(out.maxComputeWorkgroupSizeY, y);
    out.maxComputeWorkgroupSizeZ = Math.max(out.maxComputeWorkgroupSizeZ, z);
  }
  for (const m of src.matchAll(/var<workgroup>\s*\w+\s*:\s*([^;]+);/g)) {
    out.maxComputeWorkgroupStorageSize += wgslBytes(m[1].trim());
  }
  for (const m of src.matchAll(/^\s*enable\s+([\w\s,]+);/gm)) {
    for (const ext of m[1].split(",").map((s) => s.trim())) features.add(ENABLES[ext] ?? ext);
  }
  return out;
}

/** Bytes of a WGSL type as the emitters write them (scalars, vectors, atomics, arrays). */
function wgslBytes(type) {
  const scalar = { f32: 4, i32: 4, u32: 4, f16: 2, bool: 4 };
  if (type in scalar) return scalar[type];
  let m = /^atomic<\s*(\w+)\s*>$/.exec(type);
  if (m) return 4;
  m = /^vec([234])<\s*(\w+)\s*>$/.exec(type);
  if (m) return (m[1] === "3" ? 4 : Number(m[1])) * scalar[m[2]];
  m = /^array<\s*(.+)\s*,\s*(\d+)u?\s*>$/.exec(type);
  if (m) return Number(m[2]) * wgslBytes(m[1].trim());
  return 0; // unknown: pipeline creation reports it if it does not fit
}

/** A device with the program's limits and features, or an Error naming the first it lacks. */
async function openDevice(needs) {
  if (!globalThis.navigator?.gpu) {
    throw new DeviceError("WebGPU is not available in this browser (navigator.gpu is missing; " +
                          "it needs a recent browser and a secure context: https or localhost)");
  }
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new DeviceError("WebGPU is available but found no adapter (GPU)");
  checkDevice(adapter, needs, "this browser's WebGPU adapter");
  const requiredLimits = {};
  for (const [k, v] of Object.entries(needs.limits)) {
    if (v > (DEFAULT_LIMITS[k] ?? Infinity)) requiredLimits[k] = v;
  }
  if (needs.align < 256) requiredLimits.minStorageBufferOffsetAlignment = needs.align;
  const device = await adapter.requestDevice({ requiredLimits,
                                               requiredFeatures: [...needs.features] });
  return device;
}

/** Throws naming the first limit or feature ``gpu`` (an adapter or device) lacks. */
function checkDevice(gpu, needs, what) {
  for (const f of needs.features) {
    if (gpu.features.has(f)) continue;
    const why = f === "shader-f16" ? " (the program computes in f16; export it with " +
      "precision='strict' or compile(..., portable=True) for devices without f16)" : "";
    throw new DeviceError(`this program needs the WebGPU feature '${f}'${why}, which ${what} ` +
                          "does not have");
  }
  for (const [k, v] of Object.entries(needs.limits)) {
    const have = gpu.limits[k];
    if (have !== undefined && v > have) {
      throw new DeviceError(`this program needs ${k} >= ${v} but ${what} allows ${have}; ` +
                            "export it with compile(..., portable=True) to fit any device");
    }
  }
  const align = gpu.limits.minStorageBufferOffsetAlignment;
  if (align > needs.align) {
    throw new DeviceError(`this program binds buffers at multiples of ${needs.align} bytes but ` +
                          `${what} requires minStorageBufferOffsetAlignment ${align}; export it ` +
                          "with compile(..., portable=True)");
  }
}

// ------------------------------------------------------------------------------- program

/** Sizes of the pinned buffers: parameter groups and every leaf not in a group. */
function bufferSizes(manifest) {
  const sizes = new Map();
  for (const g of manifest.groups) {
    sizes.set(g.name, Math.max(4, round4(g.elements * DTYPES[g.dtype].gpuBytes)));
  }
  for (const [name, leaf] of Object.entries(manifest.leaves)) {
    if (name in manifest.group_home) continue;
    sizes.set(name, Math.max(4, round4(Math.max(1, product(leaf.shape)) * DTYPES[leaf.dtype].gpuBytes)));
  }
  for (const s of Object.values(manifest.streams)) {
    sizes.set(`${s.tag}:arena`, Math.max(256, s.arena_bytes));
    for (const [name, n] of Object.entries(s.out_buffers)) sizes.set(`${s.tag}:out:${name}`, n);
  }
  return sizes;
}

/** A loaded program: ``run`` (inference) and ``step`` (training) when the artifact has them. */
export class Program {
  constructor(device, manifest, modules, weights, base) {
    this.device = device;
    this.manifest = manifest;
    this.url = base;
    this.outputs = [...manifest.program.outputs];
    this.feeds = manifest.program.feeds; // {train: {name: {shape, dtype}}, infer: {...}}
    this._modules = modules;
    this._weights = weights;
    this._queue = Promise.resolve(); // runs one at a time: each maps its stream's readback buffer
    // after each submit, encode the stream's next step while the GPU runs this one (false:
    // encode each step when it is called)
    this.preencode = true;
    this.lost = null;
    device.lost.then((info) => { this.lost = info.message || info.reason || "lost"; });
  }

  /** Buffers, weights, pipelines and bind groups, once; a GPU validation error is an Error
   *  naming the kernel. */
  async build() {
    const d = this.device;
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    d.pushErrorScope("validation");
    d.pushErrorScope("out-of-memory");
    let failure = null;
    try {
      this.buffers = new Map();
      for (const [name, size] of bufferSizes(this.manifest)) {
        this.buffers.set(name, d.createBuffer({ size, usage, label: name }));
      }
      for (const [name, bytes] of Object.entries(this._weights)) this._write(name, bytes);
      this._weights = null;
      const pipelines = await this._pipelines();
      this.streams = {};
      for (const [tag, s] of Object.entries(this.manifest.streams)) {
        this.streams[tag] = this._stream(s, pipelines);
      }
    } catch (e) {
      failure = e; // reported after the scopes are popped: it says more than their errors
    }
    const oom = await d.popErrorScope();
    const invalid = await d.popErrorScope();
    if (failure) throw failure;
    if (oom) throw new DeviceError(`not enough GPU memory for ${this.url}: ${oom.message}`);
    if (invalid) throw new DeviceError(`the GPU rejected ${this.url}: ${invalid.message}`);
  }

  async _pipelines() {
    const d = this.device;
    const layouts = new Map();
    const layout = (n) => {
      if (!layouts.has(n)) {
        const entries = Array.from({ length: n }, (_, i) => ({
          binding: i, visibility: GPUShaderStage.COMPUTE, buffer: { type: "storage" } }));
        const bgl = d.createBindGroupLayout({ entries });
        layouts.set(n, { bgl, pl: d.createPipelineLayout({ bindGroupLayouts: [bgl] }) });
      }
      return layouts.get(n);
    };
    const shaders = this._modules.map((code, i) => d.createShaderModule({ code, label: kernelFile(i) }));
    const pipelines = new Map();
    for (const op of dispatches(this.manifest)) {
      const key = `${op.module}:${op.entry}:${op.bindings.length}`;
      if (pipelines.has(key)) continue;
      const { bgl, pl } = layout(op.bindings.length);
      const pipeline = d.createComputePipelineAsync({
        layout: pl, compute: { module: shaders[op.module], entryPoint: op.entry }, label: op.label,
      }).catch((e) => this._shaderError(shaders[op.module], op, e));
      pipelines.set(key, { pipeline, bgl });
    }
    for (const p of pipelines.values()) p.pipeline = await p.pipeline;
    return pipelines;
  }

  async _shaderError(shader, op, e) {
    const info = await shader.getCompilationInfo();
    const first = info.messages.find((m) => m.type === "error");
    const where = first ? ` at line ${first.lineNum}: ${first.message}` : `: ${e.message}`;
    throw new DeviceError(`kernel ${kernelFile(op.module)} (${op.label}) does not compile on ` +
                          `this device${where}`);
  }

  _buffer(tag, [pool, name]) {
    const key = pool === "temp" ? `${tag}:arena` : pool === "out" ? `${tag}:out:${name}` : name;
    const buf = this.buffers.get(key);
    if (!buf) throw new ArtifactError(`artifact ${this.url}: manifest.json binds an unknown buffer '${key}'`);
    return buf;
  }

  /** A stream's commands: runs of dispatches (one compute pass each) between copies. */
  _stream(s, pipelines) {
    const commands = s.ops.map((op) => {
      if ("copy" in op) {
        const [src, dst, nbytes] = op.copy;
        return { copy: [this._buffer(s.tag, src), src[2], this._buffer(s.tag, dst), dst[2], nbytes] };
      }
      const { pipeline, bgl } = pipelines.get(`${op.module}:${op.entry}:${op.bindings.length}`);
      const entries = op.bindings.map((loc, i) => ({
        binding: i, resource: { buffer: this._buffer(s.tag, loc), offset: loc[2], size: round4(loc[3]) } }));
      const bindGroup = this.device.createBindGroup({ layout: bgl, entries, label: op.label });
      return { pipeline, bindGroup, workgroups: op.workgroups };
    });
    const fetchBytes = s.fetch.reduce((a, f) => Math.max(a, f.offset + round4(f.nbytes)), 0);
    const readback = fetchBytes && this.device.createBuffer({
      size: fetchBytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, label: `${s.tag}-readback` });
    return { tag: s.tag, commands, fetch: s.fetch, readback };
  }

  /** Write a tensor's bytes (as stored in safetensors) where the program keeps it. */
  _write(name, bytes) {
    const [buf, offset] = this.manifest.group_home[name] ?? [name, 0];
    const gpu = toGPU(bytes, this.manifest.leaves[name].dtype);
    if (gpu.byteLength) this.device.queue.writeBuffer(this.buffers.get(buf), offset, gpu);
  }

  /** Inference: the outputs (typed arrays by name) for these feeds. */
  run(feeds) {
    return this._submit("infer", feeds);
  }

  /** One training step, update applied: ``__loss__`` and the outputs. */
  step(feeds) {
    return this._submit("train", feeds);
  }

  _submit(tag, feeds) {
    const stream = this.streams[tag];
    if (!stream) {
      const what = tag === "infer" ? "inference stream (no outputs)" : "training stream";
      return Promise.reject(new FeedError(`artifact ${this.url} has no ${what}`));
    }
    let arrays;
    try {
      arrays = checkFeeds(this.feeds[tag], feeds, this.manifest.program.feed_ranges);
    } catch (e) {
      return Promise.reject(e);
    }
    const result = this._queue.then(() => this._execute(stream, arrays));
    this._queue = result.catch(() => {});
    return result;
  }

  async _execute(stream, arrays) {
    if (this.lost) throw new DeviceError(`the GPU device was lost: ${this.lost}`);
    const d = this.device;
    for (const [name, bytes] of Object.entries(arrays)) this._write(name, bytes);
    d.pushErrorScope("validation");
    // the step encoded ahead by the previous call (the command stream never changes; the feeds
    // just written are queue operations ordered before this submit), then the next one, while
    // the GPU runs this one
    const cb = stream.prepared ?? this._encode(stream);
    stream.prepared = null;
    d.queue.submit([cb]);
    if (this.preencode) stream.prepared = this._encode(stream);
    const invalid = await d.popErrorScope();
    if (invalid) {
      stream.prepared = null;
      throw new DeviceError(`the GPU rejected the ${stream.tag} stream: ${invalid.message}`);
    }
    if (!stream.readback) return {};
    await stream.readback.mapAsync(GPUMapMode.READ);
    const raw = stream.readback.getMappedRange().slice(0);
    stream.readback.unmap();
    const out = {};
    for (const f of stream.fetch) out[f.name] = fromGPU(raw, f);
    return out;
  }

  /** One step's command buffer: the stream's commands and the copies of its results into the
   * readback buffer (mapped only between a submit and the next call's submit). */
  _encode(stream) {
    const enc = this.device.createCommandEncoder();
    let pass = null;
    for (const c of stream.commands) {
      if (c.copy) {
        if (pass) { pass.end(); pass = null; }
        enc.copyBufferToBuffer(...c.copy);
        continue;
      }
      pass ??= enc.beginComputePass();
      pass.setPipeline(c.pipeline);
      pass.setBindGroup(0, c.bindGroup);
      pass.dispatchWorkgroups(...c.workgroups);
    }
    if (pass) pass.end();
    for (const f of stream.fetch) {
      enc.copyBufferToBuffer(this._buffer(stream.tag, f.loc), f.loc[2], stream.readback, f.offset,
                             round4(f.nbytes));
    }
    return enc.finish();
  }

  /** Free the GPU buffers (the device stays usable for other programs). */
  destroy() {
    for (const b of this.buffers?.values() ?? []) b.destroy();
    for (const s of Object.values(this.streams ?? {})) s.readback?.destroy();
  }
}

// ------------------------------------------------------------------------------- feeds

/** Feeds as the bytes to upload, after checking names, types, lengths and value ranges. */
function checkFeeds(types, feeds, ranges) {
  feeds = feeds ?? {};
  const missing = Object.keys(types).filter((n) => !(n in feeds));
  const unknown = Object.keys(feeds).filter((n) => !(n in types));
  if (missing.length || unknown.length) {
    const parts = [];
    if (missing.length) parts.push("missing " + missing.map((n) => `'${n}' (${fmtType(types[n])})`).join(", "));
    if (unknown.length) parts.push("unknown " + unknown.map((n) => `'${n}'`).join(", "));
    throw new FeedError(`${parts.join("; ")}; expected feeds: ${Object.keys(types).join(", ")}`);
  }
  const out = {};
  for (const [name, t] of Object.entries(types)) {
    const dt = DTYPES[t.dtype];
    let a = feeds[name];
    if (Array.isArray(a)) a = dt.array.from(a, t.dtype === "bool" ? (v) => (v ? 1 : 0) : Number);
    if (!(a instanceof dt.array)) {
      throw new FeedError(`feed '${name}' must be a ${dt.array.name} or an Array (${fmtType(t)}), ` +
                          `got ${a?.constructor?.name ?? typeof a}`);
    }
    if (a.length !== product(t.shape)) {
      throw new FeedError(`feed '${name}' has ${a.length} elements; expected ${product(t.shape)} ` +
                          `(${fmtType(t)})`);
    }
    for (const [lo, hi, also, what] of ranges[name] ?? []) {
      const i = a.findIndex((v) => (v < lo || v >= hi) && !also.includes(v));
      if (i >= 0) throw new FeedError(`feed '${name}': ${what} ${a[i]} at index ${i} is outside [${lo}, ${hi})`);
    }
    out[name] = new Uint8Array(a.buffer, a.byteOffset, a.byteLength);
  }
  return out;
}

/** Stored bytes -> the GPU's (bool as u32), padded to a multiple of 4 bytes. */
function toGPU(bytes, dtype) {
  if (dtype === "bool") return new Uint8Array(Uint32Array.from(bytes, (v) => (v ? 1 : 0)).buffer);
  if (bytes.byteLength % 4 === 0 && bytes.byteOffset % 4 === 0) return bytes;
  const padded = new Uint8Array(round4(bytes.byteLength));
  padded.set(bytes);
  return padded;
}

/** A fetched result as a typed array (bool as 0/1 bytes, f16 as raw halves). */
function fromGPU(raw, f) {
  const n = product(f.shape);
  if (f.dtype === "bool") return Uint8Array.from(new Uint32Array(raw, f.offset, n), (v) => (v ? 1 : 0));
  return new DTYPES[f.dtype].array(raw.slice(f.offset, f.offset + n * DTYPES[f.dtype].gpuBytes));
}
