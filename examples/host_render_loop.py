"""Train inside a render loop: a wgpu-py application shares its GPUDevice with meganeura.

The application opens the device itself (as pygfx, fastplotlib or any rendercanvas program
does) and hands it to ``mn.compile(..., device=device)``.  Each frame it runs one training step
of the digits MLP on that device and queue, then draws the loss curve so far as bars with its
own render pipeline, into an offscreen ``rendercanvas`` canvas (a window canvas works the same
way: swap ``rendercanvas.offscreen`` for ``rendercanvas.auto`` and call ``loop.run()``).  The
last frame is written as a PNG.

    python examples/host_render_loop.py --frames 60 --out loss.png

Runs headless (lavapipe included).  Prints one line: frames, first and last loss, the PNG path.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import wgpu
from rendercanvas.offscreen import RenderCanvas

import meganeura as mn
from meganeura import optim
from meganeura.io.datasets import batches, load_digits
from meganeura.models.mlp import mlp_classifier

BATCH = 64
BG = (0.08, 0.09, 0.12, 1.0)

# One bar is two triangles; the CPU computes the corners, the GPU rasterizes them.
SHADER = """
struct VOut { @builtin(position) pos: vec4<f32>, @location(0) color: vec3<f32> };

@vertex
fn vs(@location(0) pos: vec2<f32>, @location(1) color: vec3<f32>) -> VOut {
    var o: VOut;
    o.pos = vec4<f32>(pos, 0.0, 1.0);
    o.color = color;
    return o;
}

@fragment
fn fs(v: VOut) -> @location(0) vec4<f32> {
    return vec4<f32>(v.color, 1.0);
}
"""


def open_device():
    """The application's device, opened the ordinary wgpu-py way (meganeura does not open it)."""
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    return adapter.request_device_sync(label="host-render-loop")


def make_trainer(device):
    """A digits-MLP training session on the host's device and an endless stream of batches."""
    m = mlp_classifier(BATCH)
    sess = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.AdamW(lr=1e-2, weight_decay=0.01), device=device)
    sess.init_params(seed=0)
    x, y = load_digits("train")
    stream = itertools.chain.from_iterable(
        batches(x, y, BATCH, shuffle=True, seed=epoch, drop_last=True)
        for epoch in itertools.count())
    return sess, stream


def bar_vertices(losses: list[float], slots: int) -> np.ndarray:
    """Triangle-list vertices (x, y, r, g, b) of one bar per loss, scaled to the first loss so
    the curve fills the canvas whatever the units; colour goes red → green as the loss falls."""
    top = max(losses[0], 1e-6)
    w = 1.9 / max(slots, 1)
    out = []
    for i, loss in enumerate(losses):
        h = min(loss / top, 1.0)
        x0, x1 = -0.95 + i * w, -0.95 + (i + 0.8) * w
        y0, y1 = -0.9, -0.9 + 1.8 * h
        c = (h, 1.0 - 0.6 * h, 0.3)
        for px, py in ((x0, y0), (x1, y0), (x1, y1), (x0, y0), (x1, y1), (x0, y1)):
            out.append((px, py, *c))
    return np.asarray(out, np.float32).reshape(-1, 5)


class LossPlot:
    """The application's own render pipeline: draws bars from a vertex buffer in a render pass."""

    def __init__(self, device, fmt: str, slots: int):
        self.device, self.slots = device, slots
        module = device.create_shader_module(code=SHADER)
        layout = {"array_stride": 20, "attributes": [
            {"format": "float32x2", "offset": 0, "shader_location": 0},
            {"format": "float32x3", "offset": 8, "shader_location": 1}]}
        self.pipeline = device.create_render_pipeline(
            layout="auto",
            vertex={"module": module, "entry_point": "vs", "buffers": [layout]},
            fragment={"module": module, "entry_point": "fs", "targets": [{"format": fmt}]},
            primitive={"topology": "triangle-list"},
        )
        self.vbuf = device.create_buffer(
            size=slots * 6 * 20, usage=wgpu.BufferUsage.VERTEX | wgpu.BufferUsage.COPY_DST)

    def draw(self, view, losses: list[float]) -> None:
        """Clear ``view`` and draw the bars, submitted on the shared queue after the step."""
        verts = bar_vertices(losses[-self.slots:], self.slots)
        self.device.queue.write_buffer(self.vbuf, 0, verts.tobytes())
        enc = self.device.create_command_encoder()
        rp = enc.begin_render_pass(color_attachments=[{
            "view": view, "clear_value": BG, "load_op": "clear", "store_op": "store"}])
        rp.set_pipeline(self.pipeline)
        rp.set_vertex_buffer(0, self.vbuf)
        rp.draw(len(verts))
        rp.end()
        self.device.queue.submit([enc.finish()])


def run(frames: int, out: str, size=(320, 160)) -> list[float]:
    """Render ``frames`` frames (one training step each) and save the last one to ``out``."""
    device = open_device()
    sess, data = make_trainer(device)
    canvas = RenderCanvas(size=size, pixel_ratio=1)
    context = canvas.get_wgpu_context()
    context.configure(device=device, format=None)
    losses: list[float] = []
    plot: list[LossPlot] = []

    def frame():
        xb, yb = next(data)
        losses.append(sess.step(x=xb, y=yb).loss)  # same device, same queue as the render
        texture = context.get_current_texture()
        if not plot:
            plot.append(LossPlot(device, texture.format, frames))
        plot[0].draw(texture.create_view(), losses)

    canvas.request_draw(frame)
    image = None
    for _ in range(frames):
        image = canvas.draw()
    save_png(out, np.asarray(image))
    return losses


def save_png(path: str, image: np.ndarray) -> None:
    """Write an RGBA uint8 image (matplotlib is a meganeura dependency; it writes PNGs)."""
    import matplotlib.image

    matplotlib.image.imsave(path, image[..., :3] if image.shape[-1] == 4 else image)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=60, help="frames = training steps")
    ap.add_argument("--out", default="host-render-loop.png", help="PNG of the last frame")
    args = ap.parse_args(argv)
    if args.frames < 1:
        ap.error("--frames must be at least 1")
    losses = run(args.frames, args.out)
    print(f"frames={len(losses)} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
          f"png={args.out}")


if __name__ == "__main__":
    main()
