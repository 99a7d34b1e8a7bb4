"""Optimizers besides Adam/AdamW, run per chunk by their own class: bitwise fp32 parity with the
same optimizer in plain PyTorch, torch's state-dict format, and refusals for the ones that need
whole parameters ([Note: elementwise optimizers] in runtime/elementwise.py)."""

import copy
import os

import pytest
import torch

import protrain_core as pt
from conftest import assert_same_weights, batches, tiny_gpt2, train_engine, train_reference

PLANS = [pt.Plan(n_persist=0, n_buffer=1), pt.Plan(n_persist=2, n_buffer=2)]

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.01),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
}


def assert_same_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts in torch's format are equal, bitwise."""
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for index, entry in want["state"].items():
        assert list(got["state"][index]) == list(entry), index  # the same keys, in torch's order
        for key, value in entry.items():
            mine = got["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert mine.shape == value.shape and torch.equal(mine, value), (index, key)
            else:
                assert mine == value, (index, key)


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_elementwise_optimizer_trains_bitwise_like_pytorch(name, plan):
    make = OPTIMIZERS[name]
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    data = batches(5)
    ref_opt = make(ref.parameters())
    ref_losses = train_reference(ref, ref_opt, data)
    engine = pt.wrap(model, make(model.parameters()), plan, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    assert_same_state(engine.states.optimizer(), ref_opt.state_dict())


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_an_elementwise_optimizers_state_loads_back_and_training_goes_on_exactly(plan):
    """Three steps, the state dict saved; a new engine loads it (and the weights) and trains
    two more: the same as five steps of plain PyTorch. A scheduler's lr reaches every chunk."""
    make = OPTIMIZERS["rmsprop"]
    data = batches(5)
    ref = tiny_gpt2()
    ref_opt = make(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    ref_losses = train_reference(ref, ref_opt, data, scheduler=ref_sched)

    model = tiny_gpt2()
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = pt.wrap(model, opt, plan, device="cpu")
    losses = []
    for x in data[:3]:
        losses.append(_step(engine, x, sched))
    weights, osd = engine.state_dict(), engine.states.optimizer()
    engine.close()

    model2 = tiny_gpt2(seed=5)
    model2.load_state_dict(weights)
    opt2 = make(model2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    engine2 = pt.wrap(model2, opt2, pt.Plan(n_persist=1, n_buffer=2), device="cpu")
    engine2.states.load_optimizer(osd)
    sched2.load_state_dict(sched.state_dict())
    for x in data[3:]:
        losses.append(_step(engine2, x, sched2))
    assert losses == ref_losses
    assert_same_weights(engine2.state_dict(), ref)
    assert_same_state(engine2.states.optimizer(), ref_opt.state_dict())
    # Another optimizer's state (AdamW's) is refused, nothing changed (before, merged in silently).
    adam_model = tiny_gpt2()
    adam = torch.optim.AdamW(adam_model.parameters())
    train_reference(adam_model, adam, data[:1])
    with pytest.raises(ValueError, match="'exp_avg', 'exp_avg_sq' for parameter 0, which RMSprop does not keep.*"
                                         "another optimizer's state"):
        opt2.load_state_dict(adam.state_dict())  # (the optimizer's own load: the engine's while it is open)
    assert_same_state(engine2.states.optimizer(), ref_opt.state_dict())


def _step(engine, x, scheduler) -> float:
    loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    scheduler.step()
    return loss.item()


def test_optimizers_that_need_whole_parameters_are_refused_with_the_reason():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="factored by rows and columns"):
        pt.wrap(model, torch.optim.Adafactor(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")
    with pytest.raises(ValueError, match="needs a closure"):
        pt.wrap(model, torch.optim.LBFGS(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")

    class Centralised(torch.optim.SGD):
        def step(self, closure=None):  # gradient centralisation: needs each gradient's shape
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.dim() > 1:
                        p.grad -= p.grad.mean(dim=tuple(range(1, p.grad.dim())), keepdim=True)
            return super().step(closure)

    with pytest.raises(ValueError, match="overrides step"):
        pt.wrap(model, Centralised(model.parameters(), lr=0.1), pt.Plan(n_persist=0, n_buffer=1), device="cpu")

    class Shaped(torch.optim.Optimizer):  # a state of another shape than its parameter's
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    row = self.state[p].setdefault("row", torch.zeros(p.shape[0]))
                    row.add_(p.grad.pow(2).mean(dim=-1))
                    p.add_(p.grad, alpha=-group["lr"])

    with pytest.raises(ValueError, match="'row' of a \\(3, 4\\) parameter is \\(3,\\)"):
        pt.wrap(model, Shaped(model.parameters()), pt.Plan(n_persist=0, n_buffer=1), device="cpu")


def _sharded(rank, world, out):
    """Each optimizer and plan over ``world`` gloo processes against DDP with the same optimizer:
    losses, weights and the gathered optimizer state; then a sharded checkpoint of it, loaded
    into a new engine on another plan, gives the same state back."""
    from _distributed import ddp_reference, protrain_run
    from conftest import standard_plans, tiny_llama

    results = []
    for name in ("sgd-momentum", "rmsprop"):
        for plan in ("streamed-buf1", "mixed-buf2"):
            data = batches(3, seed=10 + rank)
            ref_state: dict = {}
            ref_losses, ref_weights = ddp_reference(tiny_llama(), data, optimizer=OPTIMIZERS[name],
                                                    optimizer_state=ref_state)
            losses, engine = protrain_run(tiny_llama(), data, standard_plans(tiny_llama())[plan],
                                          optimizer=OPTIMIZERS[name])
            weights, state = engine.state_dict(), engine.states.optimizer()
            path = os.path.join(out, f"{name}-{plan}")
            engine.save_sharded(path)
            engine.close()
            model = tiny_llama(seed=3)
            again = pt.wrap(model, OPTIMIZERS[name](model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
            again.load_sharded(path)
            loaded = again.states.optimizer()
            again.close()
            if rank == 0:
                assert_same_state(state, ref_state)
                assert_same_state(loaded, ref_state)
                assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
            results.append((name, plan, losses == ref_losses))
    return results


def test_elementwise_optimizers_shard_over_processes_like_ddp(tmp_path):
    from _distributed import spawn

    for rank_results in spawn(_sharded, 2, str(tmp_path), str(tmp_path)):
        assert rank_results and all(same for *_, same in rank_results), rank_results


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
@pytest.mark.parametrize("name", ["sgd-momentum", "adagrad"])
def test_an_elementwise_optimizer_in_mixed_precision_matches_the_master_weight_recipe(name, precision, dtype):
    """As test_parity's mixed-precision parity: the same low-precision gradients land in fp32
    and the same optimizer steps the fp32 master (1 ulp of fp32 allowed per weight)."""
    from test_parity import reference_mixed

    model = tiny_gpt2()
    data = batches(6)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    ref_losses, ref_master, _ = reference_mixed(model, dtype, data, lr=None, scaler=scaler, optimizer=OPTIMIZERS[name])
    engine = pt.wrap(model, OPTIMIZERS[name](model.parameters()), pt.Plan(n_persist=1, n_buffer=2),
                     precision=precision, device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    assert train_engine(engine, data) == ref_losses
    sd = engine.state_dict()
    for key, m in ref_master.items():
        torch.testing.assert_close(sd[key], m.detach(), rtol=1.2e-7, atol=0, msg=key)
