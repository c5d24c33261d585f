"""Validated parameters: every bad value names the parameter, the value and what is allowed."""
import math
import re
import tomllib
from pathlib import Path

import pytest

from labkit import config
from labkit.config import LabParams

ROOT = Path(__file__).resolve().parent.parent


def test_glm5_shapes_from_study():
    m = config.load_model("glm5")
    assert (m.num_hidden_layers, m.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim) == (78, 64, 512, 64)
    assert m.kv_dim == 576
    assert m.sm_scale == pytest.approx(1 / math.sqrt(256))
    assert m.index_topk == 2048


def test_tiny_is_small_but_same_latent_shape():
    m = config.load_model("tiny")
    assert m.kv_dim == 576 and m.num_hidden_layers < 10


def test_defaults_validate_and_derive():
    p = LabParams.make(model="glm5", tp_size=4, pool_tokens=4096, num_layers=2, device="cpu")
    assert p.heads == 16 and p.layers == 2 and p.num_pages == 64
    assert p.pool_bytes == 2 * 4096 * 576 * 1
    assert p.lens == [1024] * 4


@pytest.mark.parametrize("kw, words", [
    (dict(page_size=3), ["page_size=3", "power of two", "128"]),
    (dict(page_size=256, pool_tokens=256 * 64), ["page_size=256", "128"]),
    (dict(pool_tokens=-5), ["pool_tokens=-5", "positive"]),
    (dict(tp_size=3), ["tp_size=3", "num_attention_heads=16", "[1, 2, 4, 8, 16]"]),
    (dict(kv_dtype="fp4"), ["kv_dtype='fp4'", "bf16", "fp8_e4m3"]),
    (dict(model="llama"), ["model='llama'", "glm5", "tiny"]),
    (dict(device="tpu"), ["device='tpu'", "cpu"]),
    (dict(num_layers=9), ["num_layers=9", "1..4"]),
    (dict(context_lens=[10, 20]), ["context_lens", "batch_size=4"]),
    (dict(context_lens=0), ["context_lens", ">= 1"]),
    (dict(context_lens="normal:3"), ["context_lens", "uniform:LOW:HIGH"]),
    (dict(pool_tokens=1024, context_lens=512), ["need 32 pages", "pool_tokens=1024", "holds 16 pages"]),
    (dict(pool_tokens=1000), ["pool_tokens=1000", "page_size=64"]),
    (dict(nonsense=1), ["unknown parameter", "nonsense", "pool_tokens"]),
])
def test_bad_values_name_parameter_and_allowed(kw, words):
    kw = {"device": "cpu", **kw}
    with pytest.raises(ValueError) as e:
        LabParams.make(**kw)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)


def test_contexts_that_do_not_fit_say_by_how_much():
    with pytest.raises(ValueError, match=r"need 10 pages of 64 tokens \(640 tokens\).*holds 8 pages"):
        LabParams.make(pool_tokens=512, batch_size=10, context_lens=64, device="cpu")


def test_pool_larger_than_memory_shows_arithmetic(monkeypatch):
    monkeypatch.setattr(config, "_device_memory_bytes", lambda dev: 8 * 2**30)
    with pytest.raises(ValueError) as e:
        LabParams.make(model="glm5", pool_tokens=495_040, page_size=64, device="cpu")
    msg = str(e.value)
    # 78 x 495040 x 576 x 1 B = 20.71 GiB
    assert "78 layers x 495040 tokens x 576 values x 1 B" in msg
    assert re.search(r"= 20\.7\d GiB", msg) and "8.00 GiB" in msg


def test_uniform_contexts_reproducible_and_in_range():
    a = config.parse_context_lens("uniform:100:300", 50, seed=3)
    assert a == config.parse_context_lens("uniform:100:300", 50, seed=3)
    assert min(a) >= 100 and max(a) <= 300 and len(set(a)) > 10


def _name(req: str) -> str:
    return re.split(r"[<>=;\[ ]", req.strip())[0].lower()


def test_environment_yml_names_pyproject_dependencies():
    import yaml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = {_name(d) for d in project["dependencies"] + project["optional-dependencies"]["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(d.startswith("python>=3.11") for d in conda)
    assert "-e .[test]" in pip
    got = {_name(d) for d in pip if not d.startswith("-e")}
    assert got == want, f"missing {sorted(want - got)}, extra {sorted(got - want)}"
