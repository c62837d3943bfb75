"""GPU checks: skipped without CUDA (CI has none). Run on a GPU machine with `pytest tests/gpu`;
`ddpgpt check` (make device-check) runs these and every other path as one matrix."""

import pytest
import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.model.gpt import GPT
from tests.helpers import read_metrics, tiny_train_args
from tests.processes import run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]


def test_loader_copies_to_the_gpu_unchanged(tiny_data):
    ds = TokenDataset(tiny_data)
    cpu = TrainLoader(ds, seq_len=32, micro_batch=4, accum_steps=2, seed=3)
    gpu = TrainLoader(ds, seq_len=32, micro_batch=4, accum_steps=2, seed=3, device="cuda")
    for _ in range(3):
        for (xc, yc), (xg, yg) in zip(cpu.next_step(), gpu.next_step()):
            assert (xg.device.type == "cuda" and torch.equal(xg.cpu(), xc)
                    and torch.equal(yg.cpu(), yc))


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_bf16_matches_fp32_closely(arch):
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128,
                            arch=arch, n_kv_head=1 if arch == "modern" else 0), seed=0).cuda()
    idx = torch.randint(0, 128, (4, 32), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    _, fp32 = model(idx, idx)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, bf16 = model(idx, idx)
    assert fp32.item() != bf16.item()  # autocast did run in bf16
    assert abs(fp32.item() - bf16.item()) < 0.05 * fp32.item()


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
@pytest.mark.parametrize("extra", [[], ["--compile"]], ids=["eager", "compile"])
def test_train_on_one_gpu(tiny_data, tmp_path, extra, arch):
    run = tmp_path / "run"
    args = tiny_train_args(tiny_data, run, steps=20, device="cuda", run__checkpoint_every=10,
                           model__arch=arch)[3:]
    r = run_cli("train", *args, *extra, timeout=500)
    assert r.returncode == 0, r.stderr
    assert "cuda, bf16" in r.stderr
    rows, _ = read_metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_one(tiny_data, tmp_path):
    results = {}
    for n in (1, 2):
        run = tmp_path / f"run{n}"
        args = tiny_train_args(tiny_data, run, steps=6, device="cuda", run__precision="fp32")[3:]
        r = run_cli("train", "--nproc", str(n), *args, timeout=500)
        assert r.returncode == 0, r.stderr
        results[n] = [x["loss"] for x in read_metrics(run)[0]]
        if n == 2:
            assert "(1 node × 2, nccl), cuda, fp32" in r.stderr
    torch.testing.assert_close(torch.tensor(results[2]), torch.tensor(results[1]), rtol=1e-4,
                               atol=0)


@pytest.mark.timeout(900)
def test_device_check_quick_passes(tmp_path):
    """The whole quick matrix on this GPU (every row against its oracle); its table is printed."""
    r = run_cli("check", "--device", "cuda", "--quick", "--out", tmp_path, timeout=880)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
