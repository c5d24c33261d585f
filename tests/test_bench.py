"""The benchmark entry point on a CPU: it checks, times and records; it proves no speed here."""
import pandas as pd

from labkit import bench, roofline


def test_cpu_bench_records_checked_rows(tmp_path, capsys):
    rc = bench.main(["--grid", "cpu", "--run-dir", str(tmp_path),
                     "--providers", "full_pool_cast.torch", "fp8_native.torch"])
    assert rc == 0
    df = pd.read_parquet(tmp_path / "bench.parquet")
    assert set(df["label"]) == {"full_pool_cast.torch", "fp8_native.torch"}
    assert len(df) == 2 * len(bench.GRIDS["cpu"])
    assert (df["rel_err"] < 5e-3).all() and (df["median_ms"] > 0).all()
    assert (df["env_torch"].str.len() > 0).all() and (df["timing_device"] == "cpu").all()
    row = df[(df.label == "fp8_native.torch") & (df["shape"] == "mem")].iloc[0]
    assert row["bytes"] == roofline.path_bytes("fp8_native", row.pool_tokens, 2 * 300, heads=4, batch=2)
    out = capsys.readouterr().out
    assert "CPU run" in out and "records ->" in out


def test_gpu_grid_refused_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("CUDA is available here")
    assert bench.main(["--grid", "gpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_shapes_fit_their_pools():
    for grid in bench.GRIDS.values():
        for s in grid:
            assert s.pool() >= s.batch * -(-s.ctx // s.page_size) * s.page_size
            assert s.pool() % s.page_size == 0


def test_labkit_bench_is_the_same_entry_point(capsys):
    import torch

    from labkit import cli

    if torch.cuda.is_available():
        import pytest

        pytest.skip("CUDA is available here")
    assert cli.main(["bench", "--grid", "gpu"]) == 2
    assert "--grid gpu needs a CUDA device" in capsys.readouterr().err
