"""The browser runtime (web/meganeura.js) in headless Chromium: an exported program gives the
Python session's results, and broken artifacts are clear errors in the page.

Needs Debian's ``chromium`` (WebGPU through its SwiftShader adapter) and ``playwright``
(``scripts/setup.sh --test`` installs both); skipped, saying so, only when one is missing."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import meganeura as mn
from meganeura.io.datasets import batches, load_digits
from meganeura.models.mlp import mlp_classifier

WEB = Path(__file__).resolve().parents[2] / "web"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Chromium's flags for WebGPU compute headless (see GPU-NOTES.md "Browsers": no Vulkan flags)
ARGS = ["--headless=new", "--no-sandbox", "--enable-unsafe-webgpu"]

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium for WebGPU in a page "
                       "(apt-get install chromium; scripts/setup.sh --test installs it)"),
    pytest.mark.skipif(sync_playwright is None, reason="needs playwright to drive chromium "
                       "(pip install playwright; it is in the test extra)"),
]

# Load an artifact through the module and run it; every failure comes back as its message.
RUN_JS = """async ([url, feeds, stream]) => {
  try {
    const m = await import('/meganeura.js');
    const p = await m.loadProgram(url);
    const typed = {};
    for (const [k, v] of Object.entries(feeds)) {
      const t = p.feeds[stream]?.[k]?.dtype === 'i32' ? Int32Array : Float32Array;
      typed[k] = new t(v);
    }
    const out = await (stream === 'infer' ? p.run(typed) : p.step(typed));
    const after = stream === 'train' && p.outputs.length ? await p.run({x: typed.x}) : {};
    const arrays = o => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, Array.from(v)]));
    return {out: arrays(out), after: arrays(after), timings: p.timings};
  } catch (e) {
    return {error: `${e.name}: ${e.message}`};
  }
}"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder served from 127.0.0.1 (a secure context: WebGPU needs one) holding web/ and
    the artifacts the tests export: (folder, base URL)."""
    root = tmp_path_factory.mktemp("site")
    shutil.copytree(WEB, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("mlp"))
    (root / "blank.html").write_text("<!doctype html><title>meganeura test</title>")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                          functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_port}/"
    srv.shutdown()


@pytest.fixture(scope="module")
def page(site):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page()
        pg.goto(site[1] + "blank.html")
        yield pg
        browser.close()


@pytest.fixture(scope="module")
def digits(gpu, site):
    """The digits MLP trained for a few epochs in Python, exported for the whole test set
    (portable: WebGPU's guaranteed limits); the Python session's logits to compare with."""
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    m = mlp_classifier(64, hidden=(32,))
    sess = mn.compile(m.graph, loss=m.loss, optimizer=mn.optim.AdamW(lr=1e-2))
    sess.init_params(seed=0)
    for epoch in range(3):
        for xb, yb in batches(xtr, ytr, 64, shuffle=True, seed=epoch, drop_last=True):
            sess.step(x=xb, y=yb)
    me = mlp_classifier(len(xte), hidden=(32,))
    infer = mn.compile(me.graph, outputs={"logits": me.logits}, portable=True)
    infer.set_params(sess.get_params())
    infer.export(site[0] / "digits")
    logits = infer.run(x=xte)["logits"]
    assert (logits.argmax(-1) == yte).mean() > 0.85  # trained: predictions worth comparing
    return xte, logits


def _run(page, url, feeds, stream="infer"):
    return page.evaluate(RUN_JS, [url, {k: np.asarray(v).ravel().tolist()
                                        for k, v in feeds.items()}, stream])


def test_browser_predicts_the_test_set_like_python(page, digits):
    x, want = digits
    r = _run(page, "digits/", {"x": x})
    assert "error" not in r, r["error"]
    got = np.asarray(r["out"]["logits"], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    assert r["timings"]["bytes"] > 0 and r["timings"]["buildMs"] > 0


def test_browser_trains_a_step_like_python(gpu, page, site):
    """The training stream: one step's loss and the outputs after the update match."""
    m = mlp_classifier(16, hidden=(16,))
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=mn.optim.AdamW(lr=1e-2), portable=True)
    s.init_params(seed=1)
    x, y = load_digits("train")
    x, y = x[:16], y[:16]
    s.export(site[0] / "train")
    r = _run(page, "train/", {"x": x, "y": y}, "train")
    assert "error" not in r, r["error"]
    want = s.step(x=x, y=y)
    np.testing.assert_allclose(r["out"]["__loss__"], [want.loss], rtol=1e-5)
    after = np.asarray(r["after"]["logits"], np.float32).reshape(16, 10)
    np.testing.assert_allclose(after, s.run(x=x)["logits"], rtol=1e-5, atol=1e-5)


STEPS_JS = """async ([url, batches, preencode]) => {
  try {
    const m = await import('/meganeura.js');
    const p = await m.loadProgram(url);
    p.preencode = preencode;
    const losses = [], logits = [];
    for (const [x, y] of batches) {
      losses.push((await p.step({x: new Float32Array(x), y: new Int32Array(y)})).__loss__[0]);
      logits.push(Array.from((await p.run({x: new Float32Array(x)})).logits));
    }
    return {losses, logits};
  } catch (e) {
    return {error: `${e.name}: ${e.message}`};
  }
}"""


@pytest.mark.parametrize("preencode", [True, False])
def test_browser_steps_encoded_ahead_see_new_feeds(gpu, page, site, preencode):
    """Several steps and runs on changing batches, each stream's next step encoded ahead
    (``Program.preencode``, the default) or on demand: the same losses and logits as Python."""
    m = mlp_classifier(16, hidden=(16,))
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=mn.optim.AdamW(lr=1e-2), portable=True)
    s.init_params(seed=2)
    s.export(site[0] / "steps")
    x, y = load_digits("train")
    batches = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(4)]
    r = page.evaluate(STEPS_JS, ["steps/", [(a.ravel().tolist(), b.tolist())
                                            for a, b in batches], preencode])
    assert "error" not in r, r["error"]
    for i, (xb, yb) in enumerate(batches):
        np.testing.assert_allclose(r["losses"][i], s.step(x=xb, y=yb).loss, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(r["logits"][i], np.float32).reshape(16, 10),
                                   s.run(x=xb)["logits"], rtol=1e-5, atol=1e-5)
    assert len(set(r["losses"])) == len(batches)  # the batches differ, so must the losses


def _broken(site, name: str, digits_dir: str = "digits") -> Path:
    root = site[0]
    shutil.rmtree(root / name, ignore_errors=True)
    shutil.copytree(root / digits_dir, root / name)
    return root / name


def _edit_manifest(folder: Path, edit) -> None:
    man = json.loads((folder / "manifest.json").read_text())
    edit(man)
    (folder / "manifest.json").write_text(json.dumps(man))


def test_broken_artifacts_are_clear_errors(page, site, digits):
    x = digits[0]
    a = _broken(site, "v2")
    _edit_manifest(a, lambda m: m.update(version=2))
    b = _broken(site, "nokernel")
    (b / "kernels" / "001.wgsl").unlink()
    c = _broken(site, "truncated")
    w = (c / "weights.safetensors").read_bytes()
    (c / "weights.safetensors").write_bytes(w[: len(w) // 2])
    d = _broken(site, "noweight")
    _edit_manifest(d, lambda m: m["program"]["persistent"].append("mlp.2.weight")
                   or m["leaves"].update({"mlp.2.weight": {"kind": "param", "shape": [3],
                                                           "dtype": "f32"}}))
    e = _broken(site, "resized")
    _edit_manifest(e, lambda m: m["leaves"]["mlp.0.weight"].update(shape=[32, 65]))
    f = _broken(site, "badwgsl")
    (f / "kernels" / "000.wgsl").write_text("fn main( {\n")
    cases = {
        "nothing-here/": "ArtifactError: artifact {}nothing-here/: manifest.json is missing "
                         "(HTTP 404)",
        "v2/": "manifest.json has format version 2; this meganeura.js reads version 1",
        "nokernel/": "kernels/001.wgsl is missing (HTTP 404)",
        "truncated/": "weights.safetensors is truncated: tensor",
        "noweight/": "weights.safetensors lacks 'mlp.2.weight' (f32[3])",
        "resized/": "weights.safetensors: 'mlp.0.weight' is F32[32, 64] (8192 bytes); the "
                    "program needs f32[32, 65]",
        "badwgsl/": "does not compile on this device at line 1: ",
    }
    for url, message in cases.items():
        r = _run(page, url, {"x": x})
        assert message.format(site[1]) in r.get("error", ""), (url, r)


def test_devices_lacking_a_limit_or_feature_are_named(page, site, digits):
    x = digits[0]
    big = _broken(site, "bigwg")
    k = big / "kernels" / "000.wgsl"
    k.write_text(k.read_text().replace("@workgroup_size(", "@workgroup_size(1024, ", 1))
    half = _broken(site, "half")
    _edit_manifest(half, lambda m: m["leaves"]["x"].update(dtype="f16"))
    r = _run(page, "bigwg/", {"x": x})
    assert "this program needs maxComputeInvocationsPerWorkgroup >= " in r["error"]
    assert "but this browser's WebGPU adapter allows 256" in r["error"]
    r = _run(page, "half/", {"x": x})
    assert "needs the WebGPU feature 'shader-f16'" in r["error"], r


def test_bad_feeds_are_clear_errors(page, digits):
    x = digits[0]
    r = _run(page, "digits/", {"x": x[:3]})
    assert r["error"] == (f"FeedError: feed 'x' has 192 elements; expected {x.size} "
                          f"(f32[{x.shape[0]}, 64])")
    r = _run(page, "digits/", {"x": x, "y": [1]})
    assert "FeedError: unknown 'y'; expected feeds: x" in r["error"]
    r = _run(page, "digits/", {"x": x}, "train")
    assert r["error"].endswith("digits/ has no training stream")


def test_demo_page_classifies_a_drawing_like_python(gpu, page, site, digits):
    """web/demo/digits.html with a batch-1 export (what ``meganeura export`` writes): a stroke
    drawn with the mouse becomes an 8x8 input whose logits match Python's; a broken artifact
    is an error shown in the page."""
    one = mlp_classifier(1, hidden=(32,))
    p = mn.compile(one.graph, outputs={"logits": one.logits}, portable=True)
    p.init_params(seed=0)
    p.export(site[0] / "demo" / "mlp")
    page.goto(site[1] + "demo/digits.html")
    page.wait_for_selector("#status[data-state]", timeout=60_000)
    assert page.get_attribute("#status", "data-state") == "ready", page.text_content("#status")
    box = page.locator("#pad").bounding_box()
    page.mouse.move(box["x"] + 128, box["y"] + 40)
    page.mouse.down()
    page.mouse.move(box["x"] + 120, box["y"] + 220, steps=10)
    page.mouse.up()
    page.wait_for_function("window.lastLogits", timeout=30_000)
    x = np.asarray(page.evaluate("window.lastInput"), np.float32).reshape(1, 64)
    assert 0 < x.max() <= 1 and x.sum() > 1  # a stroke, in the training images' range
    got = np.asarray(page.evaluate("window.lastLogits"), np.float32)
    np.testing.assert_allclose(got, p.run(x=x)["logits"][0], rtol=1e-5, atol=1e-5)
    assert page.text_content("#prediction") == str(int(got.argmax()))

    a = _broken(site, "v2-demo", "demo/mlp")
    _edit_manifest(a, lambda m: m.update(version=2))
    page.goto(site[1] + "demo/digits.html?model=../v2-demo/")
    page.wait_for_selector("#status[data-state]", timeout=60_000)
    assert "has format version 2; this meganeura.js reads version 1" in \
        page.text_content("#status")
    page.goto(site[1] + "demo/digits.html?model=../absent/")
    page.wait_for_selector("#status[data-state=error]", timeout=60_000)
    assert "meganeura export --checkpoint runs/mlp.safetensors" in page.text_content("#status")
    page.goto(site[1] + "blank.html")


DECODE_JS = """async ([url, tokens]) => {
  try {
    const m = await import('/meganeura.js');
    const p = await m.loadProgram(url);
    const logits = [];
    for (let pos = 0; pos < tokens.length; pos++) {
      const out = await p.step({ids: new Int32Array([tokens[pos]]), pos: new Int32Array([pos])});
      logits.push(Array.from(out.logits));
    }
    return {logits};
  } catch (e) {
    return {error: `${e.name}: ${e.message}`};
  }
}"""


def test_browser_decodes_a_tiny_llama_like_python(gpu, page, site):
    """A transformer decode step (KV cache kept on the device between steps as a state, the
    position an i32 scalar feed): the page's logits match Python's token after token."""
    from meganeura.generate import LlamaGenerator
    from meganeura.models.llama import tiny_llama

    gen = LlamaGenerator(tiny_llama(), max_len=16, portable=True)
    gen.decoder.init_params(seed=0)
    gen.decoder.export(site[0] / "llama")
    tokens = [5, 17, 42, 3]
    want = [gen.decode(np.array([t]))[0] for t in tokens]
    r = page.evaluate(DECODE_JS, ["llama/", tokens])
    assert "error" not in r, r["error"]
    np.testing.assert_allclose(np.asarray(r["logits"], np.float32), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
    assert np.ptp(np.asarray(want)) > 0  # logits that say something
