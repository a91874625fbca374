"""Stable-Baselines3 integration: the flight recorder as an SB3 callback.

    from recorder.sb3 import FlightRecorderCallback

    model = DQN("MlpPolicy", env)
    model.learn(10_000, callback=FlightRecorderCallback(part="q_net",
                                                       factory="mypkg.rl:make_q_net"))

The recorder attaches when training starts (``model.learn`` has built the networks and their
optimizers by then) to the network named by ``part`` (an attribute of the algorithm: its
``policy``, DQN's ``q_net``, SAC's ``critic``, TD3's ``critic`` or ``actor``) with that network's
optimizer, and detaches when training ends. PPO and A2C update their policy through
``policy.evaluate_actions``, which calls its parts, not its forward: the callback runs it
through the policy's forward while ``learn()`` runs (:func:`through_forward`), so each
minibatch's update is a recorded step, and a factory of such a policy returns
``through_forward(policy)`` for the replay to re-run it. SB3 tells a callback nothing of an exception: a
NaN observation reaching the policy's action distribution inside its forward (a
``Categorical``'s or ``Normal``'s argument check raising ``ValueError``) leaves ``learn()``
before any callback runs again. So the callback runs the algorithm's own ``collect_rollouts``
and ``train`` under the recorder's exception check (wrapped on the instance, unwrapped at
detach): the step or rollout forward the exception cut short is checked, its bundle written,
and the exception goes on with the recorder's summary as a note, as a ``with FlightRecorder``
block's exit does. Importing this module needs ``stable_baselines3``; nothing else in
``recorder`` does.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from stable_baselines3.common.callbacks import BaseCallback

from .checked_run import Wrappers
from .flight import FlightRecorder
from .settings import check_callback_options

# what the algorithm calls between callbacks: the rollouts, then the updates
GUARDED = ("collect_rollouts", "train")

# said when an update ran without a forward of the recorded network
UNROOTED_ADVICE = (
    "stable-baselines3's SAC updates its actor through actor.action_log_prob, not the actor's "
    "forward, so those updates are not recorded (the rollouts' forwards, gradients off, are "
    "still checked as each returns); DQN's q_net, SAC's critic, TD3's critic and actor, and "
    "PPO's and A2C's policy (through_forward) are updated through their forwards: record one of "
    "those with FlightRecorderCallback(part=...)")


def through_forward(policy):
    """``policy`` (an ``ActorCriticPolicy``: PPO's, A2C's) with its ``evaluate_actions`` run
    through its forward, so torch's hooks, and the recorder, see the updates: ``policy(obs,
    actions)`` evaluates the actions, ``policy(obs)`` and ``policy(obs, deterministic)`` act as
    the class's forward does. Patched on the instance; returns ``policy``. The callback does it
    while ``learn()`` runs; a factory of such a policy returns ``through_forward(policy)`` so
    the replay re-runs the same computation."""
    # (defined here, so a replay whose factory lacks the patch names through_forward:
    # recorder.patched_forward's patcher)
    def dispatching_forward(self, obs, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor):  # evaluate_actions(obs, actions, ...)
            return type(self).evaluate_actions(self, obs, *args, **kwargs)
        return type(self).forward(self, obs, *args, **kwargs)

    def evaluate_through_call(self, obs, actions, *args, **kwargs):
        return self(obs, actions, *args, **kwargs)  # (nn.Module.__call__: the hooks run)

    if "forward" not in vars(policy):
        policy.forward = types.MethodType(dispatching_forward, policy)
        policy.evaluate_actions = types.MethodType(evaluate_through_call, policy)
    return policy


class FlightRecorderCallback(BaseCallback):
    """Records ``model.learn()``'s updates of one network.

    Args:
        part: dotted name of the algorithm's attribute holding the network (``"policy"``,
            ``"q_net"``, ``"critic"``, TD3's ``"actor"``).
        optimizer: dotted name of its optimizer; ``None``: ``<part>.optimizer`` where that
            network has one, else ``policy.optimizer`` (DQN's ``q_net``).
        options: :class:`FlightRecorder`'s other keyword arguments (``out_dir``, ``factory``,
            ``on_event``, ``allow_inf``, ...), checked now. The first step's index is the
            algorithm's count of updates so far (``_n_updates``: 0 in a first ``learn()``).
    """

    def __init__(self, part: str = "policy", optimizer: str | None = None, **options: Any):
        check_callback_options(options.get("loss_fn"), options)
        super().__init__()
        self.part, self.optimizer_name, self.options = part, optimizer, options
        self.recorder: FlightRecorder | None = None
        self._wrappers = Wrappers()  # (the algorithm's GUARDED methods, until detach)
        self._patched = None  # the policy through_forward patched, undone at detach

    def _on_training_start(self) -> None:
        self.detach()  # a second learn() with the same callback
        net = _attribute(self.model, self.part, "part")
        name = self.optimizer_name or (f"{self.part}.optimizer"
                                       if hasattr(net, "optimizer") else "policy.optimizer")
        # steps numbered on from the updates an earlier learn() made (reset_num_timesteps=False
        # goes on training): DQN's and SAC's gradient steps, as SB3 counts them
        self.recorder = FlightRecorder(net, _attribute(self.model, name, "optimizer"),
                                       start_step=int(getattr(self.model, "_n_updates", 0)),
                                       **self.options)
        if hasattr(type(net), "evaluate_actions") and "forward" not in vars(net):
            self._patched = through_forward(net)  # (PPO, A2C: their updates, as forwards)
        self.recorder.integration = "sb3"
        self.recorder.target.unrooted_advice = UNROOTED_ADVICE
        self.recorder.attach()
        for method in GUARDED:
            self._wrappers.check(self, self.model, method)

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        if self.recorder is not None:  # the open step, and the last update's weights
            self.recorder.__exit__(None, None, None)
        self.detach()

    def detach(self) -> None:
        self._wrappers.undo()
        if self.recorder is not None:
            self.recorder.detach()
        if self._patched is not None:
            for name in ("forward", "evaluate_actions"):
                vars(self._patched).pop(name, None)
            self._patched = None


def _attribute(root, dotted: str, what: str):
    obj = root
    for part in dotted.split("."):
        if not hasattr(obj, part):
            example = "'critic.optimizer'" if what == "optimizer" else "'q_net', 'critic'"
            raise AttributeError(f"FlightRecorderCallback: {what}={dotted!r}: "
                                 f"{type(root).__name__} has no attribute {dotted!r}; name the "
                                 f"attribute that holds it (e.g. {example})")
        obj = getattr(obj, part)
    return obj
