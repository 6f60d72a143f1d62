"""The inner optimizer's kinds (``learners.optimizer``, DESIGN §3, issue 44 item 4).

* ``adamw``: AdamW over every trainable parameter (:func:`diloco_async.inner.workload.inner_optimizer`).
* ``muon``: ``torch.optim.Muon`` (momentum, then a Newton–Schulz orthogonalisation of each update)
  for the **2-D hidden weight matrices** (:func:`muon_parameter_names`), AdamW for the rest
  (embeddings, the LM head, norms, biases), stepped together by :class:`MuonWithAdamW`. Muon's
  learning rate is scaled by ``adjust_lr_fn="match_rms_adamw"`` (0.2 * sqrt(max(rows, cols))),
  so its updates have AdamW's RMS and one ``learners.lr`` (and its schedule) serves both groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping

import torch

from diloco_async.models import build_run_model, embedding_names, trainable_parameters

__all__ = ["INNER_OPTIMIZERS", "MuonWithAdamW", "muon_parameter_names", "check_muon_model", "check_inner_optimizer"]

#: the values of ``learners.optimizer``
INNER_OPTIMIZERS = ("adamw", "muon")


def muon_parameter_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameters Muon trains, in ``named_parameters`` order: every 2-D one that is
    not an embedding (any ``nn.Embedding``: tokens, positions), nor the output head
    (:func:`~diloco_async.models.embedding_names`, tied or not; for a model that names none, any
    ``nn.Linear`` onto an embedding's vocabulary), nor a LoRA embedding adapter
    (``lora_embedding_*``). Norm gains and biases are 1-D. With LoRA only the trainable adapter
    matrices (``lora_A``, ``lora_B``) can be among them."""
    named, names = dict(model.named_parameters()), embedding_names(model)
    skip = {id(named[n]) for n in names} if names else {id(p) for p in _vocab_matrices(model)}
    skip |= {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}  # positions too
    return [n for n, p in trainable_parameters(model).items()
            if p.dim() == 2 and id(p) not in skip and "lora_embedding" not in n]


def _vocab_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Any ``nn.Embedding``'s weight and any ``nn.Linear``'s whose output is an embedding's
    vocabulary (a head): how a factory model, which names no embeddings, shows them (not used for
    the byte-level GPT or a transformers model: a hidden width can equal the vocabulary there)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocabs = {m.num_embeddings for m in embeddings}
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features in vocabs]
    return [m.weight for m in embeddings + heads]


def check_muon_model(model: torch.nn.Module, what: str) -> list[str]:
    """:func:`muon_parameter_names` of ``model``, refused when empty.

    Raises:
        ValueError: ``learners.optimizer = 'muon'`` on a model (``what``, e.g. the model's kind)
            with no 2-D hidden weight matrix to train; the message lists its trainable shapes.
    """
    names = muon_parameter_names(model)
    if not names:
        shapes = {n: list(p.shape) for n, p in trainable_parameters(model).items()}
        raise ValueError(f"learners.optimizer = 'muon' needs 2-D hidden weight matrices, but model {what} has "
                         f"none (trainable: {shapes}; embeddings and the output head train with AdamW); "
                         "use learners.optimizer = 'adamw'")
    return names


def check_inner_optimizer(cfg) -> None:
    """Refuse, before anything starts, a ``learners.optimizer`` the run's model cannot train:
    with ``"muon"`` it builds the run's model once (``build_run_model``, as every learner will)
    and checks it has 2-D hidden weights (:func:`check_muon_model`); ``"adamw"`` needs no check.

    Raises:
        ValueError: as :func:`check_muon_model`, naming ``model.kind``.
    """
    if cfg.learners.optimizer == "muon":
        check_muon_model(build_run_model(cfg), repr(cfg.model.kind))


class _RoutedState(MutableMapping):
    """The two optimizers' ``state`` as one map keyed by parameter: reads and writes go to the
    optimizer that holds the parameter."""

    def __init__(self, owner: MuonWithAdamW) -> None:
        self._owner = owner

    def _of(self, p: torch.Tensor) -> MutableMapping:
        owner = self._owner
        return owner.muon.state if id(p) in owner.muon_ids or owner.adamw is None else owner.adamw.state

    def __getitem__(self, p):
        state = self._of(p)
        if p not in state:  # torch's state is a defaultdict: a plain lookup would add an entry
            raise KeyError(p)
        return state[p]

    def __contains__(self, p) -> bool:
        return p in self._of(p)

    def __setitem__(self, p, value) -> None:
        self._of(p)[p] = value

    def __delitem__(self, p) -> None:
        del self._of(p)[p]

    def __iter__(self) -> Iterator:
        for opt in self._owner.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._owner.optimizers)


class MuonWithAdamW:
    """``torch.optim.Muon`` over the hidden matrices and AdamW over the rest, used where the inner
    loop uses one optimizer: ``param_groups`` (Muon's, then AdamW's: setting each group's ``lr``
    sets the step's learning rate for both), ``state`` (by parameter, either optimizer's),
    ``zero_grad``, ``step`` (Muon, then AdamW), ``register_step_pre_hook`` (runs before both
    steps), ``state_dict`` / ``load_state_dict`` (``{"muon": ..., "adamw": ...}``).

    Args:
        params: the trainable parameters by name (the workload's ``params``).
        muon_names: those Muon trains (:func:`muon_parameter_names`), each 2-D.
        lr: the learning rate of both (Muon's scaled by ``match_rms_adamw``).
        weight_decay: decoupled weight decay of both.
        adamw: builds the AdamW over the other parameters
            (:func:`~diloco_async.inner.workload.inner_optimizer`'s signature).

    Raises:
        ValueError: a name of ``muon_names`` is not in ``params`` or its parameter is not 2-D.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], muon_names: list[str], *, lr: float,
                 weight_decay: float, adamw: Callable[..., torch.optim.Optimizer]) -> None:
        missing = [n for n in muon_names if n not in params or params[n].dim() != 2]
        if missing:
            raise ValueError(f"Muon parameters {missing} are not 2-D trainable parameters of the model")
        self.muon_names = list(muon_names)
        chosen = set(muon_names)
        self.muon = torch.optim.Muon([params[n] for n in muon_names], lr=lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.muon_ids = {id(params[n]) for n in muon_names}
        rest = [p for n, p in params.items() if n not in chosen]
        self.adamw = adamw(rest, lr=lr, weight_decay=weight_decay) if rest else None
        self.state = _RoutedState(self)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Muon, then AdamW when some parameter is not Muon's."""
        return [self.muon] + ([self.adamw] if self.adamw is not None else [])

    @property
    def param_groups(self) -> list[dict]:
        """Every group of both optimizers (the dicts themselves: writes reach the optimizers)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def register_step_pre_hook(self, hook: Callable) -> torch.utils.hooks.RemovableHandle:
        """``hook`` runs before Muon's step, so before both (the two step one after the other)."""
        return self.muon.register_step_pre_hook(hook)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])
