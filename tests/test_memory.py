"""labkit.memory: the CPU tracker on known allocations, the formulas by hand, torch paths measured."""
import pytest
import torch

from labkit import backends, kvpool
from labkit.memory import check, extra_memory, predicted_extra_bytes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAGE = 16


def test_tracker_counts_new_storages_only():
    x = torch.randn(1000)
    assert extra_memory(lambda: torch.empty(1000, dtype=torch.float32), "cpu") == 4000
    assert extra_memory(lambda: x.view(10, 100)[2:], "cpu") == 0  # a view allocates nothing
    assert extra_memory(lambda: x.add_(1), "cpu") == 0  # in place
    assert extra_memory(lambda: x.to(torch.bfloat16), "cpu") == 2000


def test_tracker_peak_is_the_high_water_mark():
    def freed_then_bigger():
        a = torch.empty(1000)  # 4,000 B, freed before b exists
        del a
        return torch.empty(2000)  # 8,000 B

    def both_alive():
        a = torch.empty(1000)
        b = torch.empty(2000)
        return a, b

    assert extra_memory(freed_then_bigger, "cpu") == 8000
    assert extra_memory(both_alive, "cpu") == 12000


def test_predicted_hand_counts():
    out = 64 * 16 * 512 * 2  # 1,048,576
    assert predicted_extra_bytes("full_pool_cast", 495_000, 8_192, 64, 16) == 570_240_000 + out
    assert predicted_extra_bytes("full_pool_cast", 495_000, 8_192, 64, 16, kv_dtype="bf16") == out
    assert predicted_extra_bytes("gather_cast", 495_000, 8_192, 64, 16) == 9_437_184 + out
    assert predicted_extra_bytes("fp8_native", 495_000, 8_192, 64, 16, num_splits=8) == 16_809_984 + out
    assert predicted_extra_bytes("fp8_native", 495_000, 8_192, 64, 16, num_splits=8, part_bytes=2) == 8_421_376 + out
    assert predicted_extra_bytes("bf16_pool", 495_000, 8_192, 64, 16) == out
    with pytest.raises(ValueError, match="path="):
        predicted_extra_bytes("other", 1, 1, 1, 1)


def test_check_helper():
    assert check(1100, 1000, rtol=0.1)["ok"]
    assert not check(1200, 1000, rtol=0.1)["ok"]
    assert check(1200, 1000, rtol=0.1, slack_bytes=100)["ok"]
    r = check(900, 1000)
    assert not r["ok"] and r["excess"] == -100 and r["ratio"] == pytest.approx(0.9)


def _measure(path, pool_tokens, lens=(300, 200), heads=4):
    pool = kvpool.random_pool(1, pool_tokens, PAGE)
    batch = kvpool.batch_for_pool(pool, list(lens))
    qn, qp = kvpool.make_queries(len(lens), heads)
    b = backends.get(f"{path}.torch")
    measured = extra_memory(lambda: b.decode(qn, qp, pool, 0, batch, 0.0625), "cpu")
    predicted = predicted_extra_bytes(path, pool_tokens, batch.num_pages * PAGE, len(lens), heads)
    return measured, predicted


def test_full_pool_cast_grows_by_one_bf16_row_per_pool_token():
    (m1, p1), (m2, p2) = _measure("full_pool_cast", 4096), _measure("full_pool_cast", 12288)
    assert m2 - m1 == 8192 * 576 * 2  # the layer's BF16 copy, exactly
    assert p2 - p1 == 8192 * 576 * 2
    assert m1 >= p1 and m2 >= p2


def test_gather_cast_does_not_depend_on_the_pool():
    (m1, p1), (m2, p2) = _measure("gather_cast", 4096), _measure("gather_cast", 12288)
    assert m1 == m2 and p1 == p2
    pages = -(-300 // PAGE) + -(-200 // PAGE)
    assert m1 >= pages * PAGE * 576 * 2 and m1 >= p1  # at least the BF16 copy of the pages read


def test_fp8_native_allocates_no_copy_of_kv():
    m, p = _measure("fp8_native", 12288)
    full, _ = _measure("full_pool_cast", 12288)
    rows_read = 500 * 576 * 2
    assert m < rows_read < full  # per-tile fp32 widening only: smaller than a BF16 copy of what it reads


@pytest.mark.gpu
@needs_cuda
def test_cuda_extra_memory_and_full_cast():
    assert extra_memory(lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), "cuda") == 1 << 20
    pool = kvpool.random_pool(1, 65536, 64, device="cuda")
    batch = kvpool.batch_for_pool(pool, [1024] * 4)
    qn, qp = kvpool.make_queries(4, 16, device="cuda")
    b = backends.get("full_pool_cast.torch")
    m = extra_memory(lambda: b.decode(qn, qp, pool, 0, batch, 0.0625), "cuda")
    assert m >= predicted_extra_bytes("full_pool_cast", 65536, 4096, 4, 16)
