"""``loss.backward()`` instead of ``engine.backward(loss)`` runs the engine's own pass
([Note: loss.backward()] in runtime/engine.py): plain PyTorch's training, bit for bit."""

import copy
import warnings

import pytest
import torch

import protrain_core as pt
from conftest import MODELS, assert_same_weights, batches, standard_plans, train_reference


def _train(engine, data, *, accumulate):
    """``train_engine`` with the user's own ``loss.backward()``; the gradients read through
    ``p.grad`` after each step's last backward."""
    losses, grads = [], []
    for i in range(0, len(data), accumulate):
        micro, total = data[i:i + accumulate], 0.0
        for j, x in enumerate(micro):
            with engine.no_sync() if j < len(micro) - 1 else torch.enable_grad():
                loss = engine.module(input_ids=x, labels=x).loss / len(micro)
                loss.backward()
            total += loss.item()
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
        engine.step()
        engine.zero_grad()
        losses.append(total)
    return losses, grads


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "mixed-buf2", "swap-checkpoint"])
def test_loss_backward_trains_as_plain_pytorch(plan_name, accumulate):
    model = MODELS["llama"]()
    ref = copy.deepcopy(model)
    data = batches(8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_grads = []
    ref_losses = train_reference(ref, ref_opt, data, accumulate=accumulate,
                                 clip=lambda ps: ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()}))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                     standard_plans(model)[plan_name], device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    losses, grads = _train(engine, data, accumulate=accumulate)
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)
    assert all(torch.equal(g[n], r[n]) for g, r in zip(grads, ref_grads) for n in r)
    if plan_name != "all-persistent":
        assert engine.scheduler.stats["cpu_updates"] > 0


def test_a_loss_backward_that_raised_ends_at_the_next_verb():
    """Autograd never runs its end callback after an error: the engine's next forward ends the
    pass as failed, and training goes on from the step's start, as plain PyTorch's does."""
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    data = batches(3)
    ref_losses = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True), data[1:])
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), pt.Plan(n_persist=1, n_buffer=1),
                     device="cpu")
    logits = engine.module(input_ids=data[0]).logits
    logits.register_hook(lambda g: (_ for _ in ()).throw(ValueError("the user's hook")))
    with pytest.raises(ValueError, match="the user's hook"):
        (logits.float().pow(2).mean() + engine.module(input_ids=data[0], labels=data[0]).loss).backward()
    engine.zero_grad()
    losses, _ = _train(engine, data[1:], accumulate=1)
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)


@pytest.mark.parametrize("then", ["step", "zero_grad", "zero_grad expected late"])
@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1", "swap-checkpoint"])
def test_training_goes_on_after_a_backward_that_raised_midway(plan_name, then):
    """An error in the middle of backward (a block's hook; an OOM a user catches to skip the
    batch): ``step()`` after it applies the gradients that arrived, as torch's does; ``zero_grad()``
    is allowed, warns where chunks were already updated during the backward (then, unlike torch, they
    stay updated) and is exact under ``expect_late()`` ([Note: a backward that raised])."""
    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    data = batches(4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)[plan_name],
                     device="cpu", config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    if then == "zero_grad expected late":
        engine.clipping.expect_late()

    def raising(_module, _grad_in, _grad_out):
        raise ValueError("the user's backward hook")

    arrived = []  # p.grad after the failed backward: what arrived, as torch leaves it

    def train(m, backward, step, zero_grad):
        losses = []
        for i, x in enumerate(data):
            handle = m.transformer.h[1].register_full_backward_hook(raising) if i == 1 else None
            loss = m(input_ids=x, labels=x).loss
            losses.append(loss.item())
            try:
                backward(loss)
            except ValueError:
                handle.remove()
                arrived.append({n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()})
                if then == "step":
                    step()
                zero_grad()
                continue
            step()
            zero_grad()
        return losses

    ref_losses = train(ref, lambda loss: loss.backward(), ref_opt.step, ref_opt.zero_grad)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses = train(model, engine.backward, engine.step, engine.zero_grad)
    updated = [str(w.message) for w in seen if "A backward raised after ProTrain had updated" in str(w.message)]
    streamed_updates = plan_name != "all-persistent" and then != "zero_grad expected late"
    assert len(updated) == int(streamed_updates)
    assert arrived[0].keys() == arrived[1].keys()
    assert any(g is None for g in arrived[0].values()) and any(g is not None for g in arrived[0].values())
    for n, g in arrived[0].items():
        assert (g is None and arrived[1][n] is None) or torch.equal(g, arrived[1][n]), n
    if streamed_updates and then == "zero_grad":  # the chunks updated during the failed backward stay so
        assert losses[:2] == ref_losses[:2] and losses[2] != ref_losses[2]
        return
    assert losses == ref_losses
    assert_same_weights(engine.state_dict(), ref)


def test_loss_backward_is_refused_where_the_loss_itself_is_needed():
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu",
                     precision="16-mixed")
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"precision='16-mixed': the loss is scaled first. Call engine.backward"):
        engine.module(input_ids=x, labels=x).loss.backward()


def test_a_backward_started_inside_the_step_is_refused_with_the_fix():
    """The optimizer's own step hooks run inside ``engine.step()``, after the update: a backward
    there (torch would apply its gradients in this step) is refused, naming where it ran."""
    model = MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters())
    engine = pt.wrap(model, opt, pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    x = batches(1)[0]
    opt.register_step_pre_hook(lambda *_: engine.module(input_ids=x, labels=x).loss.backward())
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match=r"inside engine.step\(\), from the optimizer's step hooks"):
        engine.step()


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_loss_backward_trains_as_engine_backward(precision):
    """On a GPU autograd runs the hooks, and so the pass's opening and its end callback, on its
    device thread: the same losses and weights as ``engine.backward(loss)``, bit for bit, on a
    streamed plan with swapped and checkpointed blocks."""
    runs = []
    for plain in (False, True):
        model = MODELS["llama"]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), standard_plans(model)["swap-checkpoint"],
                         device="cuda", precision=precision)
        losses = []
        for x in batches(6, device="cuda"):
            loss = engine.module(input_ids=x, labels=x).loss
            loss.backward() if plain else engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        runs.append((losses, engine.state_dict()))
        engine.close()
    (l0, w0), (l1, w1) = runs
    assert l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("plan_name", ["streamed-buf1", "swap-checkpoint"])
def test_an_input_gradient_through_the_model_then_training_equals_plain_pytorch(plan_name):
    """``torch.autograd.grad`` of the input embeddings (an adversarial example, FGSM) runs
    through the model's hooks without a parameter gradient: not the step's backward; the
    training step on the perturbed input that follows is plain PyTorch's, bit for bit."""
    def run(model, backward, step):
        losses = []
        for x in batches(3):
            emb = model.transformer.wte(x).detach().requires_grad_(True)
            (g,) = torch.autograd.grad(model(inputs_embeds=emb, labels=x).loss, emb)
            loss = model(inputs_embeds=emb + 0.01 * g.sign(), labels=x).loss
            backward(loss)
            step()
            losses.append(loss.item())
        return losses

    model = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    expected = run(ref, lambda loss: loss.backward(), lambda: (ref_opt.step(), ref_opt.zero_grad()))
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), standard_plans(model)[plan_name],
                     device="cpu")
    assert run(engine.module, engine.backward, lambda: (engine.step(), engine.zero_grad())) == expected
    assert_same_weights(engine.state_dict(), ref)


def test_a_backward_with_create_graph_is_refused_before_anything_is_released():
    """A gradient penalty's ``create_graph=True`` backward would leave a graph that reads
    streamed parameters after their release (it crashed the process): refused at its first hook."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    x = batches(1)[0]
    emb = model.transformer.wte(x).detach().requires_grad_(True)
    with pytest.raises(RuntimeError, match="create_graph=True reached ProTrain-managed modules"):
        torch.autograd.grad(engine.module(inputs_embeds=emb, labels=x).loss, emb, create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True reached ProTrain-managed modules"):  # (its own pass)
        engine.backward(engine.module(input_ids=x, labels=x).loss, run=lambda loss: loss.backward(create_graph=True))


def test_an_input_gradient_between_the_steps_backward_and_step_is_refused_with_the_fix():
    """The step's backward finished its gradients; torch would let an input gradient through,
    but its pass would begin a second backward of the step: refused, saying when to run it."""
    model = MODELS["gpt2"]()
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    emb = model.transformer.wte(x).detach().requires_grad_(True)
    with pytest.raises(RuntimeError, match="between the step's backward and engine.step.*after the step"):
        torch.autograd.grad(engine.module(inputs_embeds=emb, labels=x).loss, emb)
    engine.step()


@pytest.mark.parametrize("d_plan", ["streamed-buf1", "mixed-buf2"])
def test_a_generator_loss_through_a_second_engines_discriminator_trains_as_plain_pytorch(d_plan):
    """Two engines, a GAN's pattern: the generator's loss backpropagates through the
    discriminator (another engine's model), then the discriminator's gradients are cleared. That
    pass is not the discriminator's step: its gradients land and ``zero_grad`` clears them, as
    torch's. Before, its offloaded chunks were updated with the generator's loss and the
    ``zero_grad`` was refused."""
    import torch.nn.functional as F

    from conftest import tiny_llama

    def run(plain):
        G, D = MODELS["gpt2"](), tiny_llama(seed=1)
        og = torch.optim.AdamW(G.parameters(), lr=3e-3, fused=plain)
        od = torch.optim.AdamW(D.parameters(), lr=2e-3, fused=plain)
        if plain:
            eg = ed = None
            backward_g, backward_d = (lambda loss: loss.backward()), (lambda loss: loss.backward())
            step_g, step_d, zero_g, zero_d = og.step, od.step, og.zero_grad, od.zero_grad
        else:
            eg = pt.wrap(G, og, standard_plans(G)["streamed-buf1"], device="cpu")
            ed = pt.wrap(D, od, standard_plans(D)[d_plan], device="cpu")
            backward_g, backward_d, step_g, step_d, zero_g, zero_d = (
                eg.backward, ed.backward, eg.step, ed.step, eg.zero_grad, ed.zero_grad)
        losses = []
        for x in batches(3, seed=3):
            real = torch.randn(*x.shape, 32, generator=torch.Generator().manual_seed(int(x.sum())))
            with torch.no_grad():
                fake = G.transformer(input_ids=x).last_hidden_state
            d_loss = F.softplus(D(inputs_embeds=fake).logits[..., 0]).mean() + F.softplus(
                -D(inputs_embeds=real).logits[..., 0]).mean()
            backward_d(d_loss)
            step_d()
            zero_d()
            g_loss = F.softplus(-D(inputs_embeds=G.transformer(input_ids=x).last_hidden_state).logits[..., 0]).mean()
            backward_g(g_loss)
            step_g()
            zero_g()
            zero_d()  # the generator's loss reached the discriminator's parameters: not its step
            losses.append((d_loss.item(), g_loss.item()))
        return losses, (G, D) if plain else (eg.state_dict(), ed.state_dict())

    ref_losses, (G, D) = run(plain=True)
    losses, (g_state, d_state) = run(plain=False)
    assert losses == ref_losses
    assert_same_weights(g_state, G)
    assert_same_weights(d_state, D)
