"""``mn.from_torch`` against PyTorch (issue 17): imported models match PyTorch float32 on the
CPU — forward relative L2 ≤ 1e-5, every parameter gradient ≤ 1e-4 — on the reference backend
(every model) and on the GPU path (lavapipe in CI; a representative subset at tiny sizes)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import meganeura as mn
from meganeura.models.resnet import resnet

from ..models.twins_vision import TorchResNet
from . import torch_models as tm
from .torch_check import gates


def _ce(out, y):
    return F.cross_entropy(out, y)


def _seq_ce(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg).eval()


def _bert_loss(out, w):
    return (out.last_hidden_state * w).sum() + out.pooler_output.pow(2).sum()


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=32, max_position_embeddings=16,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _case(name):
    """(module, inputs, loss, targets) of one gate case, seeded."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    cases = {
        "mlp": lambda: (tm.mlp(), (torch.randn(4, 8),), _ce, (torch.tensor([0, 1, 2, 3]),)),
        "cnn": lambda: (tm.SmallCNN().train(), (torch.randn(2, 3, 8, 8),), _ce,
                        (torch.tensor([0, 4]),)),
        # training mode: batch statistics; 64² keeps layer4's batch statistics over 2·2·2
        # values (at 32² they are over 2 values and amplify rounding ~100×, in PyTorch too)
        "resnet18": lambda: (TorchResNet(resnet("resnet18", 1).config).train(),
                             (torch.randn(2, 3, 64, 64),), _ce, (torch.tensor([0, 4]),)),
        "mobilenet_v3_small": lambda: (tm.MobileNetV3Small(10).eval(),
                                       (torch.randn(2, 3, 32, 32),), _ce,
                                       (torch.tensor([0, 4]),)),
        "nanogpt": lambda: (tm.NanoGPT(), (ids,), _seq_ce, (torch.roll(ids, 1, 1),)),
        "unet_block": lambda: (tm.UNetBlock(), (torch.randn(2, 8, 6, 6),),
                               lambda o, y: F.mse_loss(o, y), (torch.randn(2, 8, 6, 6),)),
        "bert": lambda: (_bert(), (torch.randint(0, 50, (2, 8)),), _bert_loss,
                         (torch.randn(2, 8, 16),)),
        # padding: the attention mask is an input, so HF's additive mask is built at run time
        "bert_padded": lambda: (_bert(), (torch.randint(0, 50, (2, 8)),
                                          torch.tensor([[1] * 8, [1] * 5 + [0] * 3])),
                                _bert_loss, (torch.randn(2, 8, 16),)),
        "llama": lambda: (_llama(), (torch.randint(0, 50, (2, 8)),), _seq_ce,
                          (torch.randint(0, 50, (2, 8)),)),
    }
    return cases[name]()


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "mobilenet_v3_small", "nanogpt",
                                  "unet_block", "bert", "bert_padded", "llama"])
def test_reference_backend_matches_pytorch(name):
    module, inputs, loss, targets = _case(name)
    gates(module, inputs, loss, targets, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cnn", "nanogpt", "unet_block"])
def test_gpu_matches_pytorch(gpu, name):
    module, inputs, loss, targets = _case(name)
    gates(module, inputs, loss, targets, backend="wgpu", device=gpu)


def test_training_mode_batch_norm_updates_running_statistics():
    """The export's buffer mutations become state updates: after one step the running mean,
    variance and batch counter equal PyTorch's after one training-mode forward."""
    torch.manual_seed(0)
    module = tm.SmallCNN().train()
    x = torch.randn(2, 3, 8, 8)
    imp = mn.from_torch(module, (x,), loss=_ce, loss_inputs=(torch.tensor([1, 2]),))
    assert set(imp.states) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    sess = imp.compile(mn.optim.SGD(lr=0.0), backend="reference")
    sess.step(x=x.numpy(), target=np.array([1, 2], np.int32))
    module(x)
    got = sess.get_state()
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        ref = getattr(module.bn, k).numpy()
        np.testing.assert_allclose(got[f"bn.{k}"], ref, rtol=1e-5, atol=1e-7, err_msg=k)


def test_eval_mode_uses_running_statistics_and_no_updates():
    torch.manual_seed(0)
    module = tm.SmallCNN()
    with torch.no_grad():
        module.bn.running_mean.uniform_(-1, 1)
        module.bn.running_var.uniform_(0.5, 2)
    module.eval()
    x = torch.randn(2, 3, 8, 8)
    imp = mn.from_torch(module, x)
    assert not imp.graph.updates and imp.loss is None
    out = imp.compile(backend="reference").run(x=x.numpy())["output"]
    np.testing.assert_allclose(out, module(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_output_names_follow_the_output_structure():
    class Two(torch.nn.Module):
        def forward(self, a, b):
            return {"sum": a + b, "pair": (a * b, a - b)}

    imp = mn.from_torch(Two(), (torch.ones(2), torch.ones(2)))
    assert list(imp.inputs) == ["a", "b"]
    assert sorted(imp.outputs) == ["pair.0", "pair.1", "sum"]


def test_tied_weights_are_one_parameter():
    imp = mn.from_torch(tm.NanoGPT(), torch.zeros(2, 8, dtype=torch.int64))
    assert "wte.weight" in imp.params and "lm_head.weight" not in imp.graph.params


def test_sdpa_becomes_our_fused_attention_every_time():
    """``scaled_dot_product_attention`` is kept whole by the decomposition and becomes one
    ``attention`` op per call (the flash kernel), not bmm + softmax; also on a second import in
    the same process (a directly called ``OpOverloadPacket.__getattr__`` once broke that)."""
    for _ in range(2):
        imp = mn.from_torch(tm.NanoGPT(), torch.zeros(2, 8, dtype=torch.int64))
        ops_used = [n.op for n in imp.graph.nodes]
        assert ops_used.count("attention") == 2 and "softmax" not in ops_used, ops_used
