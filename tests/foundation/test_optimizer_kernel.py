"""train.optimizer_kernel: the optimizer step's implementation (run/api.py optimizer_kernel).

``fused`` (the default) is one kernel over every tensor where torch has one for the device; it
computes the same update as torch's per-tensor loop, element by element, so trained weights
agree to float rounding. Tolerance: fp32 rtol 1e-5 after 5 steps (the kernels order the same
few multiply-adds differently; measured differences are ~1e-7 relative), but for one element in a
thousand within 1e-3: Adam turns a last-bit difference in a near-zero gradient into a step of up
to lr (seen on an AVX-512 host: 1 of 16,384 elements off by 5e-7)."""
import pytest
import torch

from shardwise.bench.harness import gpt_bench_config
from shardwise.launch.world import assert_close_but_for_strays
from shardwise.models import build_model, lm_loss
from shardwise.run.api import optimizer_factory, optimizer_kernel


def _config(kernel: str, optimizer: str = "adamw"):
    return gpt_bench_config("single", train={"optimizer_kernel": kernel, "optimizer": optimizer,
                                             "weight_decay": 0.1},
                            model={"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 16})


def _train(kernel: str, optimizer: str, steps: int = 5):
    cfg = _config(kernel, optimizer)
    model = build_model(cfg.model, 0)
    opt = optimizer_factory(cfg)(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.block_size), generator=g)
        lm_loss(model(x), torch.roll(x, -1, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, [p.detach().clone() for p in model.parameters()]


def test_the_default_is_fused_on_cpu_and_each_kernel_is_what_it_says():
    from shardwise.config import TrainConfig
    assert TrainConfig().optimizer_kernel == "fused"
    for kernel, key, want in (("fused", "fused", True), ("foreach", "foreach", True),
                              ("loop", "foreach", False)):
        for optimizer in ("adamw", "adam", "sgd"):
            opt, _ = _train(kernel, optimizer, steps=1)
            assert opt.defaults[key] is want, (kernel, optimizer, opt.defaults)


def test_fused_and_foreach_equal_the_loop():
    for optimizer in ("adamw", "adam", "sgd"):
        _, ref = _train("loop", optimizer)
        for kernel in ("fused", "foreach"):
            _, got = _train(kernel, optimizer)
            for a, b in zip(got, ref):
                assert_close_but_for_strays(a, b, 1e-5, 1e-7, f"{optimizer} {kernel}")


def test_fused_falls_back_to_foreach_where_torch_has_no_fused_kernel():
    ints = [torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)]
    assert optimizer_kernel(ints, "fused") == {"foreach": True}      # no fused integer step
    # a meta tensor is a parameter not made yet (ZeRO-3's probe): fused, as it will be
    assert optimizer_kernel([torch.nn.Parameter(torch.empty(3, device="meta"))], "fused") == \
        {"fused": True}
    assert optimizer_kernel([torch.nn.Parameter(torch.zeros(3))], "fused") == {"fused": True}
    assert optimizer_kernel([{"params": [torch.nn.Parameter(torch.zeros(3))]}], "fused") == \
        {"fused": True}


def _dtensor_step(rank, world):
    from torch.distributed.tensor import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh))
    plain = torch.nn.Parameter(torch.zeros(2))          # a replicated norm, say: a plain tensor
    kernel = optimizer_kernel([p, plain], "fused")
    opt = torch.optim.AdamW([p, plain], lr=0.1, **kernel)
    p.grad, plain.grad = distribute_tensor(torch.ones(4), mesh), torch.ones(2)
    opt.step()          # fused or foreach would raise "mixed torch.Tensor and DTensor"
    return kernel, p.full_tensor().tolist()


def test_dtensor_parameters_step_with_the_loop():
    # a PyTorch peer's tensor parallelism (bench peers take our kernel choice): torch's fused
    # and foreach steps refuse DTensors mixed with tensors, so "fused" falls back to the loop
    from shardwise.launch.world import run_world
    for kernel, values in run_world(_dtensor_step, 2, timeout=60):
        assert kernel == {"foreach": False}
        assert values == pytest.approx([-0.1] * 4, rel=1e-5)   # Adam's first step: -lr x sign(grad)
