"""labkit.stepmodel against the seed's own figures: 64.6 ms cast, 69% of decode, 10.5 and 13.5 tok/s."""
import pytest

from labkit import stepmodel as sm
from labkit.stepmodel import SEED


def test_step_and_rate_arithmetic():
    assert sm.step_ms(0.5, 78, 20.0) == pytest.approx(59.0)
    assert sm.tokens_per_s(50.0) == pytest.approx(20.0)
    assert sm.tokens_per_s(50.0, batch=8) == pytest.approx(160.0)


def test_seed_constants():
    assert (SEED.cast_ms_per_step, SEED.cast_share, SEED.tok_s, SEED.gather_cast_tok_s) == (64.6, 0.69, 10.5, 13.5)
    assert (SEED.pool_tokens, SEED.layers) == (495_000, 78) and "Blackwell" in SEED.device


def test_seed_figures_are_consistent():
    step = 1000 / 10.5  # 95.24 ms per token, single stream
    assert sm.seed_step_ms() == pytest.approx(step)
    assert sm.rest_from_seed() == pytest.approx(step - 64.6)  # 30.64 ms
    # 64.6 ms of a 95.2 ms step is 67.8%: the seed's "69%" agrees to within its rounding
    assert 64.6 / step == pytest.approx(SEED.cast_share, abs=0.015)
    assert sm.cast_ms_per_layer() == pytest.approx(64.6 / 78)  # 0.83 ms, the H200 measured 0.827 ms


def test_seed_cast_bandwidth():
    assert sm.seed_cast_gbps() == pytest.approx(495_000 * 1_728 / (64.6 / 78) / 1e6)  # ~1,033 GB/s


def test_seed_check_rows():
    df = sm.seed_check(context_tokens=(8_192, 131_072, 495_000)).set_index("assumption")
    full = df[df.path == "full_pool_cast"].iloc[0]
    assert full.tok_s == pytest.approx(10.5)
    gather = df[(df.path == "gather_cast") & df.implied_tokens.isna()]
    assert list(gather.tok_s) == sorted(gather.tok_s, reverse=True)  # more tokens cast, slower
    assert gather.tok_s.iloc[-1] == pytest.approx(10.5)  # casting all 495K rows is the full cast again
    rest = 1000 / 10.5 - 64.6
    assert gather.step_ms.iloc[0] == pytest.approx(rest + 64.6 * 8_192 / 495_000)
    measured = df[df.implied_tokens.notna()].iloc[0]
    assert measured.tok_s == pytest.approx(13.5)
    # 1000/13.5 - rest = 43.4 ms of gather+cast = 333K rows per layer at the seed's cast speed
    assert measured.implied_tokens == pytest.approx((1000 / 13.5 - rest) / (64.6 / 495_000))
    assert 300_000 < measured.implied_tokens < 350_000
    fp8 = df[df.path == "fp8_native"].iloc[0]
    assert fp8.tok_s == pytest.approx(1000 / rest) and fp8.tok_s > 13.5


def test_predict():
    df = sm.predict({"full_pool_cast": 0.83, "fp8_native": 0.02}, layers=78, rest_ms=30.0)
    assert list(df.columns) == ["path", "step_ms", "tok_s"]
    assert df.step_ms.tolist() == pytest.approx([78 * 0.83 + 30, 78 * 0.02 + 30])
    assert df.tok_s.tolist() == pytest.approx([1000 / (78 * 0.83 + 30), 1000 / (78 * 0.02 + 30)])


def test_step_from_the_selected_implementations():
    from labkit import backends, kvpool

    pool = kvpool.random_pool(2, 512, 16, seed=1)
    batch = kvpool.batch_for_pool(pool, [100, 37], seed=2)
    qn, qp = kvpool.make_queries(2, 4, seed=3)
    df = sm.predict_selected(qn, qp, pool, batch, 1 / 16, model_layers=78, rest_ms=30.0, precision="accurate")
    assert list(df.path) == ["full_pool_cast", "gather_cast", "fp8_native"]
    for r in df.itertuples():
        assert r.backend == backends.select(r.path, qn, pool, batch, "accurate").name  # torch on a CPU
        assert r.ms_per_layer > 0 and r.step_ms == pytest.approx(78 * r.ms_per_layer + 30.0)
        assert r.tok_s == pytest.approx(2 * 1e3 / r.step_ms)
