"""Property-based: small training set-ups drawn from recorder options, loop styles, model
features and optimizers. Healthy runs train bit-identically with and without the recorder, leave
no event and no hook behind; a NaN planted into one row of one micro-batch's input at step K is
an ``input`` event at step K naming that row."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import optimizer as optim_module

from recorder import FlightRecorder, NonFiniteError

B, T = 4, 3


class Net(nn.Module):
    def __init__(self, bn: bool, drop: bool, seq: str, mask: bool):
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.2) if drop else nn.Identity()
        self.seq = {"lstm": nn.LSTM(8, 8, batch_first=True), "none": None,
                    "mha": nn.MultiheadAttention(8, 2, batch_first=True)}[seq]
        self.kind, self.score, self.head = seq, nn.Linear(8, 1), nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x, mask=None):
        h = self.drop(self.act(self.bn(self.lin1(x).transpose(1, 2)).transpose(1, 2)))
        if self.kind == "lstm":
            h = self.seq(h)[0]
        elif self.kind == "mha":
            h = self.seq(h, h, h, need_weights=False)[0]
        s = self.score(h * self.scale).squeeze(-1) + (0 if mask is None else mask)
        pooled = (torch.softmax(s, 1).unsqueeze(-1) * h).sum(1)
        return {"logits": self.head(pooled), "pooled": pooled}


OPTS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}

SETUPS = st.fixed_dictionaries(dict(
    bn=st.booleans(), drop=st.booleans(), seq=st.sampled_from(["none", "lstm", "mha"]),
    mask=st.booleans(), rewind=st.sampled_from([None, 2]), guard=st.booleans(),
    stats=st.sampled_from(["minmax", "full"]), strict=st.booleans(), loss_fn=st.booleans(),
    accum=st.integers(1, 3), set_none=st.booleans(), clip=st.booleans(), sched=st.booleans(),
    bf16=st.booleans(), evalfwd=st.booleans(), opt=st.sampled_from(sorted(OPTS)),
    plant=st.sampled_from([None, (1, 0, 2), (2, 1, 0)])))  # (step, micro-batch, row)


def _batch(g, setup, step, micro):
    x, y = torch.randn(B, T, 4, generator=g), torch.randint(0, 3, (B,), generator=g)
    mask = torch.zeros(B, T)
    mask[:, 1:][torch.rand(B, T - 1, generator=g) < 0.5] = float("-inf")  # (col 0 stays)
    if setup["plant"] is not None and (setup["plant"][0], min(  # (the last one there is)
            setup["plant"][1], setup["accum"] - 1)) == (step, micro):
        x[setup["plant"][2], 0, 1] = float("nan")
    return x, y, (mask if setup["mask"] else None)


def _hooks(model, opt):
    """Every hook dict and patched attribute the recorder could leave behind."""
    mm, oo = torch.nn.modules.module, optim_module
    found = [(n, a) for n, m in model.named_modules() for a in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        if getattr(m, a)] + [n for n, m in model.named_modules() if "forward" in vars(m)]
    found += [n for n, p in model.named_parameters()
              if p._post_accumulate_grad_hooks or p._backward_hooks]
    found += [a for a in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
              if getattr(opt, a)] + [a for a in ("step", "zero_grad") if a in vars(opt)]
    found += [a for a in ("_global_forward_hooks", "_global_forward_pre_hooks",
                          "_global_backward_hooks", "_global_backward_pre_hooks")
              if getattr(mm, a)]
    return found + [a for a in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
                    if getattr(oo, a)]


def _train(setup, out_dir, record):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Net(setup["bn"], setup["drop"], setup["seq"], setup["mask"])
    opt = OPTS[setup["opt"]](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9) if setup["sched"] else None
    crit = nn.CrossEntropyLoss() if setup["loss_fn"] else F.cross_entropy
    rec = FlightRecorder(
        model, opt, loss_fn=crit if setup["loss_fn"] else None, out_dir=out_dir,
        rewind=setup["rewind"], guard_optimizer=setup["guard"], stats=setup["stats"],
        strict_inf=setup["strict"], allow_inf=["args[1]"], lr_scheduler=sched) if record else None
    losses, error, before = [], None, _hooks(model, opt)  # (the scheduler wraps opt.step)
    try:
        with rec if rec is not None else torch.enable_grad():
            for step in range(3):
                opt.zero_grad(set_to_none=setup["set_none"])
                total = 0.0
                for micro in range(setup["accum"]):
                    x, y, mask = _batch(g, setup, step, micro)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup["bf16"]):
                        out = model(x) if mask is None else model(x, mask)
                    loss = crit(out["logits"].float(), y) / setup["accum"]
                    loss.backward()
                    total += loss.item()
                if setup["clip"]:
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if sched is not None:
                    sched.step()
                losses.append(total)
                if setup["evalfwd"]:
                    model.eval()
                    with torch.no_grad():
                        model(_batch(g, setup, -1, -1)[0])
                    model.train()
    except NonFiniteError as e:
        error = e
    left = [h for h in _hooks(model, opt) if h not in before]
    return losses, model, opt, torch.get_rng_state(), error, left


@settings(max_examples=30, derandomize=True, deadline=None, database=None)
@given(SETUPS)
@example(dict(bn=True, drop=True, seq="lstm", mask=True, rewind=2, guard=True, stats="full",
              strict=True, loss_fn=False, accum=3, set_none=False, clip=True, sched=True,
              bf16=True, evalfwd=True, opt="adamw_fused", plant=(2, 1, 0)))
def test_loop_shapes(tmp_path_factory, setup):
    out_dir = tmp_path_factory.mktemp("bundles")
    losses, model, opt, rng, error, left = _train(setup, out_dir, record=True)
    assert not left
    if setup["plant"] is not None:
        step, micro, row = setup["plant"]
        micro = min(micro, setup["accum"] - 1)
        assert error is not None
        ev = error.event
        assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (
            step, "input", micro, [row])
        return
    assert error is None and not list(out_dir.iterdir())
    base = _train(setup, out_dir, record=False)
    assert losses == base[0] and torch.equal(rng, base[3])
    for a, b in zip(model.state_dict().values(), base[1].state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), base[2].state.values()):
        assert all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("step", [1, 2])
def test_nan_from_a_hook_on_a_relu(tmp_path, step):
    """A forward hook of the loop's own on ``act`` (an ``nn.ReLU``) writes NaN into row 1 of
    its output at ``step``: the event is ``act``'s, at that step, on row 1 (the recorder
    derived a ReLU's statistics from its input's, blind to the rewritten output, and named
    the next Linear, "whose inputs were finite")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    at = {"step": 0}

    def plant(module, args, out):
        if at["step"] == step:
            out = out.clone()
            out[1] = float("nan")
        return out
    model[1].register_forward_hook(plant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for at["step"] in range(step + 1):
                opt.zero_grad()
                crit(model(torch.randn(4, 4)), torch.randint(0, 3, (4,))).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (step, "forward", "1", [1])
