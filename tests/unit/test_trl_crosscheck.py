"""Cross-check of streamrl's algorithm library against TRL 1.13 (a test-only dependency).

The same inputs (random rewards for several groups, random per-token log-probs of the current,
old, reference and behaviour policies, right-padded completion masks of uneven lengths, finite
garbage in the padding) go through TRL's own code and through `streamrl.trainer.algos`; losses,
gradients w.r.t. the current log-probs and advantages must agree to `ATOL = 1e-6`. Both sides run
in float64; the largest difference seen over all comparisons was 2.2e-16.

How TRL is called (nothing of TRL is copied): one real `GRPOTrainer` and one `RLOOTrainer` are
built per module on the tiny local model. `_get_per_token_logps_and_entropies` is replaced by a
function that hands back our tensors (the current log-probs as a leaf with a gradient), so
`_compute_loss` runs on known inputs; for advantages, `_generate` is replaced by one returning
completions of our lengths and a reward function returns our rewards, so the real
`_generate_and_score_completions` computes TRL's advantages (and, with `use_vllm` switched on,
its vLLM importance-sampling ratio from our sampling log-probs). TRL casts reward-function
outputs to float32, so rewards are drawn on a 1/64 grid (exact in float32) and the call runs
with float64 as the default dtype; everything after that cast is float64.

| TRL 1.13 | streamrl |
| --- | --- |
| GRPO advantages, `scale_rewards` group / batch / none (unbiased std + 1e-4) | `grpo_advantages(scale=..., unbiased=True, eps=1e-4)` |
| a reward function returning None (unscorable; TRL's nan-aware mean/std) | the sample left out (streamrl's uneven groups), advantage 0 |
| RLOO advantages, with `reward_clip_range=(-b, b)` and beta > 0 (k1 summed, in the reward) | `clip_rewards(R, b) - beta * sum_t kl_estimate(old, ref, "k1")`, then `rloo_advantages` |
| RLOO `normalize_advantages=True` (equal groups of G) | `reinforce_pp_baseline_advantages(eps=1e-4 (G-1)/G)` (exact identity, see below) |
| `loss_type="grpo"` | `loss_agg="seq_mean_token_mean"` |
| `"bnpo"`, `"dapo"` (one micro-batch, one process) | `"token_mean"` |
| `"dr_grpo"` | `"constant"`, `loss_agg_constant=max_completion_length` |
| `"luspo"` | `"seq_mean_token_sum"` |
| `"cispo"` (cap = `epsilon_high`) | `policy_loss="cispo"`, `cispo_max_ratio=epsilon_high`, `"token_mean"` |
| `epsilon`, `epsilon_high` | `clip_eps_low`, `clip_eps_high` |
| `delta` (two-sided clip, delta > 1 + epsilon_high) | `dual_clip=delta` (see below) |
| `importance_sampling_level="token"` / `"sequence"` | `policy_loss="ppo"` / `"gspo"` |
| `trl.experimental.gspo_token`, level `"sequence_token"` | `policy_loss="gspo_token"` |
| `beta` with `use_bias_correction_kl=False` (k3 in the loss) | `kl_coef=beta`, `kl_estimator="k3"` |
| `beta` with `use_bias_correction_kl=True` (TRL 1.13's default), on-policy | value: `"k3"`; gradient: `"k2"` |
| `entropy_coef` (bnpo / dapo) | `entropy_coef` with `"token_mean"` |
| `vllm_importance_sampling_mode` token/sequence _truncate / _mask | `is_mode` tis / mis, `is_level` token / sequence |
| RLOO loss, gradient at ratio 1 | `policy_loss="ppo"`, `"seq_mean_token_sum"` |

Conventions that differ (documented, not bugs):

- The KL term. TRL 1.13 defaults to `use_bias_correction_kl=True`: the per-token k3 is multiplied
  by the (differentiable) ratio r = pi / pi_old, following DeepSeek-V3.2. Its gradient is
  `r * log(pi / pi_ref) * grad l` (the unbiased reverse-KL gradient), while streamrl's plain k3 in
  the loss (the GRPO paper's form, TRL's `use_bias_correction_kl=False`) has gradient
  `(1 - pi_ref / pi) * grad l`, whose expectation is the gradient of the *forward* KL. Same value
  on-policy, different gradients even there. The loss cross-checks therefore set
  `use_bias_correction_kl=False`; separately, on-policy (r = 1) TRL's default equals streamrl's k3
  in value and streamrl's `kl_estimator="k2"` (gradient `log(pi / pi_ref) grad l`) in gradient,
  which is checked. Off-policy (r != 1) streamrl has no counterpart of the corrected term.
- `delta` vs `dual_clip`: TRL bounds the unclipped branch, `-min(min(r, d) A, clip(r) A)`; with
  d > 1 + eps_high this changes nothing for A > 0 and caps the loss of A < 0 at d |A|, which is
  exactly dual-clip PPO's `min(loss, -c A)` with c = d (values and gradients). For d <= 1 + eps_high
  they differ (TRL then also bounds positive advantages); streamrl's GSPO has no dual clip.
- RLOO's loss clips the *sequence* ratio `exp(sum_t l - sum_t l_old)` and averages over
  sequences. streamrl has no loss on that un-normalised sequence ratio (GSPO uses the
  length-normalised mean). At ratio 1 (one step per batch) the gradient,
  `-1/B sum_i A_i sum_t grad l_it`, equals streamrl's ppo + seq_mean_token_sum, which is what is
  checked; the loss *values* differ even there (TRL `-mean_i A_i`, streamrl
  `-1/B sum_i |o_i| A_i`), and away from ratio 1 the two objectives differ.
- RLOO `normalize_advantages` z-scores the leave-one-out advantages over the batch with eps 1e-4.
  For full groups of G, A_loo = G/(G-1) (R - mean_g R) has batch mean 0, so this equals
  streamrl's REINFORCE++-baseline `(R - mean_g R) / (std + eps')` with eps' = 1e-4 (G-1)/G. With
  unequal groups (unscorable samples) there is no streamrl counterpart.
- Empty completions: TRL's grpo / dr_grpo / luspo count an empty completion in the number of
  sequences (`.mean()`, `B * max_completion_length`); streamrl gives it a normaliser share of 0.
  The inputs here have no empty completion.
- The entropy bonus: TRL always subtracts `coef *` the token mean of the entropy, whatever the
  loss_type; streamrl subtracts it per token and aggregates it like the policy loss, so the two
  coincide for token_mean (bnpo / dapo, checked) and differ for the other aggregations.
- KL in RLOO's reward: TRL uses the old (training-engine) log-probs, streamrl's advantage role
  the rollout (behaviour) log-probs; the same without an inference engine. Here both get the same
  tensor.
- dapo / cispo normalise by the token count of the whole generation batch across processes and
  accumulation steps, bnpo by the micro-batch's; streamrl divides by the normaliser shares summed
  over the optimizer step (the learner's part, not checked here). Here there is one micro-batch
  on one process, where all three are the same.

TRL 1.13 features with no streamrl counterpart (not cross-checked): `loss_type="sapo"` (soft
gate) and `"vespo"` (gamma-weighted sequence ratio); `use_bias_correction_kl=True` off-policy
(KL times a ratio != 1); `off_policy_mask_threshold` (DeepSeek-V3.2 off-policy sequence mask);
`top_entropy_quantile` (high-entropy token mask); `multi_objective_aggregation=
"normalize_then_sum"` (GDPO-style); `mask_truncated_completions` (`algorithm.shaping.mask_truncated`:
the trainer leaves the rows out, outside the algorithm library; tested in `test_grpo.py`); `delta` with sequence-level importance sampling (streamrl's GSPO has no dual
clip); TRL's truncate modes with a lower bound `vllm_importance_sampling_clip_min` (streamrl's TIS
only caps from above).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach a hub
import trl  # noqa: E402  (test-only dependency, installed by .[test]: a missing install must fail)
from datasets import Dataset  # noqa: E402  (installed with trl)
from transformers import AutoTokenizer  # noqa: E402
from trl.experimental.gspo_token import GRPOTrainer as GSPOTokenTrainer  # noqa: E402

from streamrl.config.schema import AlgorithmConfig
from streamrl.models.tiny import build_tiny_model_dir  # noqa: E402
from streamrl.trainer.algos.advantages import (  # noqa: E402
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from streamrl.trainer.algos.losses import batch_normaliser, kl_estimate  # noqa: E402
from streamrl.trainer.algos.objective import LossSettings, policy_loss_sum  # noqa: E402
from streamrl.trainer.algos.shaping import clip_rewards  # noqa: E402

ATOL = 1e-6
GROUPS, G, T = 4, 4, 7  # 16 completions of 1..7 tokens
B = GROUPS * G
MAX_COMPLETION_LENGTH = 9  # dr_grpo's constant (>= T)
BETA = 0.04
DTYPE = torch.float64

# -- shared inputs ------------------------------------------------------------------------------


def make_batch(seed: int, *, num_groups: int = GROUPS, group_size: int = G) -> dict[str, Any]:
    """Random rewards, lengths, masks and log-probs; padding holds finite garbage."""
    gen = torch.Generator().manual_seed(seed)
    b = num_groups * group_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    lengths = torch.randint(1, T + 1, (b,), generator=gen)
    lengths[0] = T
    mask = (torch.arange(T) < lengths.unsqueeze(1)).to(DTYPE)
    current = -(torch.rand(b, T, generator=gen, dtype=DTYPE) * 2 + 0.05)
    # Per-token noise plus a per-sequence offset, so token and sequence ratios both leave the clip.
    old = current + 0.4 * randn(b, T) + 0.3 * randn(b, 1)
    ref = current + 0.3 * randn(b, T)
    behav = old + 0.35 * randn(b, T)
    # Rewards on a 1/64 grid (exact in TRL's float32); the last group is constant.
    rewards = (torch.randint(-128, 129, (b,), generator=gen) / 64).to(DTYPE)
    rewards[-group_size:] = 0.75
    return {
        "lengths": lengths.tolist(),
        "mask": mask,
        "current": current,
        "old": old,
        "ref": ref,
        "behav": behav,
        "advantages": randn(b),
        "token_advantages": randn(b, T),
        "entropies": torch.rand(b, T, generator=gen, dtype=DTYPE) * 3,
        "rewards": rewards.tolist(),
        "group": torch.arange(b) // group_size,
    }


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    return make_batch(0)


# -- the TRL trainers -----------------------------------------------------------------------------

REWARDS: dict[str, list[float | None]] = {"values": []}


def table_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: the rewards the current test put in REWARDS."""
    assert len(REWARDS["values"]) == len(prompts)
    return list(REWARDS["values"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trl_tiny") / "model"
    return build_tiny_model_dir(out, hidden_size=32, num_layers=1, num_heads=2, seed=0)


def _common_args(out: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "per_device_train_batch_size": G,
        "num_generations": G,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "beta": BETA,  # > 0 so that a reference model exists; tests set `trainer.beta`
        "report_to": "none",
        "save_strategy": "no",
    }


def _ready(trainer: Any) -> Any:
    trainer.model.train()  # the "train" branches of TRL's normalisers
    trainer.current_gradient_accumulation_steps = 1  # set by HF's training loop otherwise
    return trainer


@pytest.fixture(scope="module")
def grpo(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    args = trl.GRPOConfig(**_common_args(tmp_path_factory.mktemp("grpo_out")))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=table_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * G}),
        processing_class=tokenizer,
    )
    return _ready(trainer)


@pytest.fixture(scope="module")
def rloo(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    args = trl.RLOOConfig(**_common_args(tmp_path_factory.mktemp("rloo_out")))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = trl.RLOOTrainer(
        model=str(model_dir),
        reward_funcs=table_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b"] * G}),
        processing_class=tokenizer,
    )
    return _ready(trainer)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fake_forward(
    trainer: Any, *, current: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, entropies: Any
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, None]]:
    """Stands in for `_get_per_token_logps_and_entropies`: the reference model gets `ref`, the
    no-grad pass of generation gets `old`, the loss's pass gets `current` (with its gradient)."""

    def forward(model: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        if model is trainer.ref_model:
            return ref, entropies.detach(), None
        if not torch.is_grad_enabled():
            return old, entropies.detach(), None
        return current, entropies, None

    return forward


def grpo_generate(lengths: list[int], sampling: torch.Tensor | None) -> Callable[..., tuple]:
    """Stands in for GRPOTrainer._generate: completions of the given lengths."""

    def generate(prompts: list[Any]) -> tuple:
        completion_ids = [[7] * n for n in lengths]
        logprobs = (
            None if sampling is None else [sampling[i, :n].tolist() for i, n in enumerate(lengths)]
        )
        prompt_ids = [[5, 6] for _ in lengths]
        return prompt_ids, completion_ids, None, ["x"] * len(lengths), logprobs, {}, None, []

    return generate


def rloo_generate(lengths: list[int]) -> Callable[..., tuple]:
    """Stands in for RLOOTrainer._generate."""

    def generate(prompts: list[Any]) -> tuple:
        return [[5, 6] for _ in lengths], [[7] * n for n in lengths], ["x"] * len(lengths)

    return generate


def score(
    trainer: Any,
    monkeypatch: pytest.MonkeyPatch,
    batch: dict[str, Any],
    rewards: list[float | None],
    *,
    sampling: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Run TRL's real `_generate_and_score_completions` on our completions and rewards."""
    current = batch["current"].clone().requires_grad_()
    monkeypatch.setattr(
        trainer,
        "_get_per_token_logps_and_entropies",
        fake_forward(
            trainer,
            current=current,
            old=batch["old"],
            ref=batch["ref"],
            entropies=batch["entropies"],
        ),
    )
    if isinstance(trainer, trl.GRPOTrainer):
        monkeypatch.setattr(trainer, "_generate", grpo_generate(batch["lengths"], sampling))
    else:
        monkeypatch.setattr(trainer, "_generate", rloo_generate(batch["lengths"]))
    monkeypatch.setitem(REWARDS, "values", rewards)
    with default_dtype(DTYPE):
        return trainer._generate_and_score_completions([{"prompt": "a b"}] * len(rewards))


def trl_loss(
    trainer: Any,
    monkeypatch: pytest.MonkeyPatch,
    inputs: dict[str, Any],
    batch: dict[str, Any],
    *,
    compute_loss: Callable[..., torch.Tensor] | None = None,
    wrt_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """TRL's `_compute_loss` on our current log-probs: (loss, d loss / d logp, d loss / d H)."""
    current = batch["current"].clone().requires_grad_()
    entropies = batch["entropies"].clone().requires_grad_(wrt_entropy)
    monkeypatch.setattr(
        trainer,
        "_get_per_token_logps_and_entropies",
        fake_forward(
            trainer, current=current, old=batch["old"], ref=batch["ref"], entropies=entropies
        ),
    )
    loss = (compute_loss or type(trainer)._compute_loss)(trainer, trainer.model, inputs)
    wrt = [current, entropies] if wrt_entropy else [current]
    grads = torch.autograd.grad(loss, wrt)
    return loss.detach(), grads[0], grads[1] if wrt_entropy else None


def loss_inputs(batch: dict[str, Any], advantages: torch.Tensor) -> dict[str, Any]:
    """`_compute_loss` inputs as `_generate_and_score_completions` would hand them over."""
    mask = batch["mask"].long()
    return {
        "prompt_ids": torch.full((len(mask), 2), 5),
        "prompt_mask": torch.ones(len(mask), 2, dtype=torch.long),
        "completion_ids": torch.full_like(mask, 7),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": mask.sum(),
    }


def streamrl_loss(
    batch: dict[str, Any],
    advantages: torch.Tensor,
    settings: LossSettings,
    *,
    behav: torch.Tensor | None = None,
    wrt_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """streamrl's loss (sum / normaliser) and its gradients, like the learner computes them."""
    current = batch["current"].clone().requires_grad_()
    entropies = batch["entropies"].clone().requires_grad_(wrt_entropy)
    mask = batch["mask"]
    loss_sum, _ = policy_loss_sum(
        current,
        batch["old"] if behav is None else behav,
        advantages,
        mask,
        settings,
        prox_bt=batch["old"],
        ref_bt=batch["ref"],
        entropy_bt=entropies,
    )
    loss = loss_sum / batch_normaliser(mask, settings.loss.agg, settings.agg_constant)
    wrt = [current, entropies] if wrt_entropy else [current]
    grads = torch.autograd.grad(loss, wrt)
    return loss.detach(), grads[0], grads[1] if wrt_entropy else None


def assert_agree(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.to(DTYPE), expected.to(DTYPE), atol=ATOL, rtol=0)


# -- the inputs exercise every branch -----------------------------------------------------------


def test_inputs_reach_every_clip_branch(batch: dict[str, Any]) -> None:
    mask = batch["mask"].bool()
    ratio = torch.exp(batch["current"] - batch["old"])[mask]
    adv = batch["advantages"].unsqueeze(1).expand_as(mask)[mask]
    assert ((ratio > 1.28) & (adv > 0)).any() and ((ratio < 0.8) & (adv < 0)).any()
    assert ((ratio > 1.5) & (adv < 0)).any()  # the dual clip / delta acts
    lengths = batch["mask"].sum(-1)
    seq = torch.exp(((batch["current"] - batch["old"]) * batch["mask"]).sum(-1) / lengths)
    assert ((seq > 1.28) & (batch["advantages"] > 0)).any()
    assert ((seq < 0.8) & (batch["advantages"] < 0)).any()
    assert len(set(batch["lengths"])) > 3


# -- advantages -------------------------------------------------------------------------------------


def streamrl_grpo_advantages(
    rewards: list[float | None], group: torch.Tensor, scale: str
) -> torch.Tensor:
    """streamrl's GRPO advantages; unscored samples are left out and get 0."""
    present = torch.tensor([r is not None for r in rewards])
    values = torch.tensor([r for r in rewards if r is not None], dtype=DTYPE)
    out = torch.zeros(len(rewards), dtype=DTYPE)
    out[present] = grpo_advantages(values, group[present], scale=scale, unbiased=True, eps=1e-4)
    return out


@pytest.mark.parametrize("unscorable", [False, True], ids=["all_scored", "some_unscored"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages(
    grpo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, scale: str, unscorable: bool
) -> None:
    monkeypatch.setattr(grpo, "scale_rewards", scale)
    monkeypatch.setattr(grpo, "beta", 0.0)
    rewards: list[float | None] = list(batch["rewards"])
    if unscorable:  # uneven groups: sizes 3, 4, 1 and the constant one of 4
        for i in (1, 8, 9, 10):
            rewards[i] = None
    out = score(grpo, monkeypatch, batch, rewards)
    expected = streamrl_grpo_advantages(rewards, batch["group"], scale)
    assert_agree(out["advantages"], expected)
    assert torch.equal(out["advantages"][-G:], torch.zeros(G, dtype=DTYPE))  # constant group


@pytest.mark.parametrize("group_size", [2, 8])
def test_grpo_advantages_other_group_sizes(
    grpo: Any, monkeypatch: pytest.MonkeyPatch, group_size: int
) -> None:
    small = make_batch(3, num_groups=16 // group_size, group_size=group_size)
    monkeypatch.setattr(grpo, "num_generations", group_size)
    monkeypatch.setattr(grpo, "beta", 0.0)
    for scale in ("group", "batch", "none"):
        monkeypatch.setattr(grpo, "scale_rewards", scale)
        out = score(grpo, monkeypatch, small, small["rewards"])
        assert_agree(
            out["advantages"], streamrl_grpo_advantages(small["rewards"], small["group"], scale)
        )


def streamrl_rloo_rewards(
    batch: dict[str, Any], rewards: list[float | None], *, beta: float, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the scored samples after clipping and the k1 KL penalty, and a presence mask."""
    present = torch.tensor([r is not None for r in rewards])
    values = clip_rewards(torch.tensor([r for r in rewards if r is not None], dtype=DTYPE), clip)
    if beta:
        kl = (kl_estimate(batch["old"], batch["ref"], "k1") * batch["mask"]).sum(-1)
        values = values - beta * kl[present]
    return values, present


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("unscorable", [False, True], ids=["all_scored", "some_unscored"])
def test_rloo_advantages(
    rloo: Any,
    batch: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    clip: float | None,
    unscorable: bool,
) -> None:
    monkeypatch.setattr(rloo, "beta", beta)
    monkeypatch.setattr(rloo, "reward_clip_range", None if clip is None else (-clip, clip))
    monkeypatch.setattr(rloo, "normalize_advantages", False)
    rewards: list[float | None] = list(batch["rewards"])
    if unscorable:
        for i in (1, 8, 9, 10):
            rewards[i] = None
    out = score(rloo, monkeypatch, batch, rewards)
    values, present = streamrl_rloo_rewards(batch, rewards, beta=beta, clip=clip)
    expected = torch.zeros(B, dtype=DTYPE)
    expected[present] = rloo_advantages(values, batch["group"][present])
    assert_agree(out["advantages"], expected)


@pytest.mark.parametrize("beta", [0.0, BETA])
def test_rloo_normalized_advantages_are_reinforce_pp_baseline(
    rloo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, beta: float
) -> None:
    monkeypatch.setattr(rloo, "beta", beta)
    monkeypatch.setattr(rloo, "reward_clip_range", None)
    monkeypatch.setattr(rloo, "normalize_advantages", True)
    out = score(rloo, monkeypatch, batch, batch["rewards"])
    values, _ = streamrl_rloo_rewards(batch, batch["rewards"], beta=beta, clip=None)
    expected = reinforce_pp_baseline_advantages(values, batch["group"], eps=1e-4 * (G - 1) / G)
    assert_agree(out["advantages"], expected)


# -- GRPO-family losses -------------------------------------------------------------------------

# (TRL loss_type, TRL importance_sampling_level, extra TRL settings) -> streamrl LossSettings.
LOSS_CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "grpo": ("grpo", "token", {}, {"loss.agg": "seq_mean_token_mean"}),
    "grpo_clip_higher": (
        "grpo",
        "token",
        {"epsilon_high": 0.28},
        {"loss.agg": "seq_mean_token_mean", "loss.clip_eps_high": 0.28},
    ),
    "bnpo": ("bnpo", "token", {}, {"loss.agg": "token_mean"}),
    "dapo": (
        "dapo",
        "token",
        {"epsilon_high": 0.28},
        {"loss.agg": "token_mean", "loss.clip_eps_high": 0.28},
    ),
    "dr_grpo": (
        "dr_grpo",
        "token",
        {},
        {"loss.agg": "constant", "loss.agg_constant": MAX_COMPLETION_LENGTH},
    ),
    "luspo_token": ("luspo", "token", {}, {"loss.agg": "seq_mean_token_sum"}),
    "cispo": (
        "cispo",
        "token",
        {"epsilon_high": 1.25},
        {"loss.type": "cispo", "loss.cispo_max_ratio": 1.25, "loss.agg": "token_mean"},
    ),
    "grpo_delta": (
        "grpo",
        "token",
        {"epsilon_high": 0.28, "delta": 1.5},
        {"loss.agg": "seq_mean_token_mean", "loss.clip_eps_high": 0.28, "loss.dual_clip": 1.5},
    ),
    "dapo_delta": (
        "dapo",
        "token",
        {"delta": 1.5},
        {"loss.agg": "token_mean", "loss.dual_clip": 1.5},
    ),
    "gspo": ("grpo", "sequence", {}, {"loss.type": "gspo", "loss.agg": "seq_mean_token_mean"}),
    "gspo_clip_higher": (
        "grpo",
        "sequence",
        {"epsilon": 0.1, "epsilon_high": 0.15},
        {
            "loss.type": "gspo",
            "loss.agg": "seq_mean_token_mean",
            "loss.clip_eps_low": 0.1,
            "loss.clip_eps_high": 0.15,
        },
    ),
    "gspo_luspo": (
        "luspo",
        "sequence",
        {},
        {"loss.type": "gspo", "loss.agg": "seq_mean_token_sum"},
    ),
    "gspo_bnpo": ("bnpo", "sequence", {}, {"loss.type": "gspo", "loss.agg": "token_mean"}),
    "gspo_dapo": ("dapo", "sequence", {}, {"loss.type": "gspo", "loss.agg": "token_mean"}),
    "gspo_dr_grpo": (
        "dr_grpo",
        "sequence",
        {},
        {
            "loss.type": "gspo",
            "loss.agg": "constant",
            "loss.agg_constant": MAX_COMPLETION_LENGTH,
        },
    ),
    "gspo_token": (
        "grpo",
        "sequence_token",
        {},
        {"loss.type": "gspo_token", "loss.agg": "seq_mean_token_mean"},
    ),
    "gspo_token_dapo": (
        "dapo",
        "sequence_token",
        {"epsilon_high": 0.28},
        {"loss.type": "gspo_token", "loss.agg": "token_mean", "loss.clip_eps_high": 0.28},
    ),
}


def configure(
    trainer: Any,
    monkeypatch: pytest.MonkeyPatch,
    *,
    loss_type: str,
    level: str,
    beta: float,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    bias_correction_kl: bool = False,
) -> None:
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer, "epsilon_low", epsilon)
    monkeypatch.setattr(trainer, "epsilon_high", epsilon if epsilon_high is None else epsilon_high)
    monkeypatch.setattr(trainer.args, "delta", delta)
    monkeypatch.setattr(trainer.args, "use_bias_correction_kl", bias_correction_kl)
    monkeypatch.setattr(trainer, "max_completion_length", MAX_COMPLETION_LENGTH)


def settings_for(beta: float, keys: dict[str, Any] | None = None) -> LossSettings:
    """The objective's settings from `algorithm` keys (`loss.agg`, `off_policy.tis_cap`, ...) over
    a PPO-clip base with the KL of `beta`."""
    values = {
        "loss.type": "ppo",
        "loss.clip_eps_low": 0.2,
        "loss.clip_eps_high": 0.2,
        "kl.coef": beta,
        "kl.estimator": "k3",
        "off_policy.correction": "none",
        **(keys or {}),
    }
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        nested.setdefault(section, {})[name] = value
    return LossSettings.of(AlgorithmConfig.model_validate(nested), MAX_COMPLETION_LENGTH)


@pytest.mark.parametrize("beta", [0.0, BETA], ids=["beta0", "beta"])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_grpo_family_loss_and_gradient(
    grpo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, case: str, beta: float
) -> None:
    loss_type, level, trl_extra, streamrl_settings = LOSS_CASES[case]
    configure(grpo, monkeypatch, loss_type=loss_type, level=level, beta=beta, **trl_extra)
    compute = GSPOTokenTrainer._compute_loss if level == "sequence_token" else None
    adv = batch["advantages"]
    trl_value, trl_grad, _ = trl_loss(
        grpo, monkeypatch, loss_inputs(batch, adv), batch, compute_loss=compute
    )
    value, grad, _ = streamrl_loss(batch, adv, settings_for(beta, streamrl_settings))
    assert_agree(value, trl_value)
    assert_agree(grad, trl_grad)
    assert trl_grad.abs().max() > 1e-3  # not a vacuous comparison


@pytest.mark.parametrize(
    "loss_type,loss_agg", [("dapo", "token_mean"), ("grpo", "seq_mean_token_mean")]
)
def test_per_token_advantages(
    grpo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, loss_type: str, loss_agg: str
) -> None:
    """TRL accepts [B, T] advantages (MiniLLM); so does streamrl."""
    configure(grpo, monkeypatch, loss_type=loss_type, level="token", beta=BETA, epsilon_high=0.28)
    adv = batch["token_advantages"]
    trl_value, trl_grad, _ = trl_loss(grpo, monkeypatch, loss_inputs(batch, adv), batch)
    value, grad, _ = streamrl_loss(
        batch, adv, settings_for(BETA, {"loss.agg": loss_agg, "loss.clip_eps_high": 0.28})
    )
    assert_agree(value, trl_value)
    assert_agree(grad, trl_grad)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_entropy_bonus_with_token_mean(
    grpo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, loss_type: str
) -> None:
    configure(grpo, monkeypatch, loss_type=loss_type, level="token", beta=BETA)
    monkeypatch.setattr(grpo, "entropy_coef", 0.01)
    monkeypatch.setattr(grpo, "_entropy_bonus_enabled", True)
    adv = batch["advantages"]
    trl_value, trl_grad, trl_dh = trl_loss(
        grpo, monkeypatch, loss_inputs(batch, adv), batch, wrt_entropy=True
    )
    settings = settings_for(BETA, {"loss.agg": "token_mean", "loss.entropy_coef": 0.01})
    value, grad, dh = streamrl_loss(batch, adv, settings, wrt_entropy=True)
    assert_agree(value, trl_value)
    assert_agree(grad, trl_grad)
    assert trl_dh is not None and dh is not None
    assert_agree(dh, trl_dh)


@pytest.mark.parametrize(
    "loss_type,loss_agg", [("dapo", "token_mean"), ("grpo", "seq_mean_token_mean")]
)
def test_bias_corrected_kl_on_policy(
    grpo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, loss_type: str, loss_agg: str
) -> None:
    """TRL 1.13's default KL (k3 times the ratio): on-policy, streamrl's k3 in value and k2 in
    gradient; streamrl's k3 gradient differs (see the module docstring)."""
    on_policy = {**batch, "old": batch["current"]}
    configure(
        grpo, monkeypatch, loss_type=loss_type, level="token", beta=BETA, bias_correction_kl=True
    )
    adv = batch["advantages"]
    trl_value, trl_grad, _ = trl_loss(grpo, monkeypatch, loss_inputs(on_policy, adv), on_policy)
    k3_value, k3_grad, _ = streamrl_loss(on_policy, adv, settings_for(BETA, {"loss.agg": loss_agg}))
    k2_settings = settings_for(BETA, {"loss.agg": loss_agg, "kl.estimator": "k2"})
    _, k2_grad, _ = streamrl_loss(on_policy, adv, k2_settings)
    assert_agree(k3_value, trl_value)
    assert_agree(k2_grad, trl_grad)
    assert (k3_grad - trl_grad).abs().max() > 10 * ATOL  # beta-sized, yet clearly apart


# -- off-policy correction (TRL's vLLM importance sampling) ---------------------------------------

IS_CASES = {
    "token_truncate": (
        {"vllm_importance_sampling_clip_max": 1.3},
        {"off_policy.correction": "tis", "off_policy.tis_cap": 1.3},
    ),
    "token_mask": (
        {"vllm_importance_sampling_clip_min": 0.6, "vllm_importance_sampling_clip_max": 1.5},
        {"off_policy.correction": "mis", "off_policy.mis_low": 0.6, "off_policy.mis_high": 1.5},
    ),
    "sequence_truncate": (
        {"vllm_importance_sampling_clip_max": 1.3},
        {"off_policy.correction": "tis", "off_policy.level": "sequence", "off_policy.tis_cap": 1.3},
    ),
    "sequence_mask": (
        {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0},
        {
            "off_policy.correction": "mis",
            "off_policy.level": "sequence",
            "off_policy.mis_low": 0.5,
            "off_policy.mis_high": 2.0,
        },
    ),
}


@pytest.mark.parametrize(
    "loss_type,loss_agg", [("dapo", "token_mean"), ("grpo", "seq_mean_token_mean")]
)
@pytest.mark.parametrize("mode", list(IS_CASES))
def test_end_to_end_with_importance_sampling(
    grpo: Any,
    batch: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    loss_type: str,
    loss_agg: str,
) -> None:
    """TRL's whole path: advantages and the vLLM IS ratio from `_generate_and_score_completions`
    (sampling log-probs = our behaviour log-probs), then `_compute_loss`, with the k3 KL."""
    trl_is, streamrl_is = IS_CASES[mode]
    configure(grpo, monkeypatch, loss_type=loss_type, level="token", beta=BETA, epsilon_high=0.28)
    monkeypatch.setattr(grpo, "scale_rewards", "group")
    monkeypatch.setattr(grpo, "use_vllm", True)
    monkeypatch.setattr(grpo, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(grpo, "vllm_importance_sampling_mode", mode)
    monkeypatch.setattr(grpo, "vllm_importance_sampling_clip_min", None)
    for name, value in trl_is.items():
        monkeypatch.setattr(grpo, name, value)
    inputs = score(grpo, monkeypatch, batch, batch["rewards"], sampling=batch["behav"])
    torch.testing.assert_close(inputs["completion_mask"].to(DTYPE), batch["mask"], atol=0, rtol=0)
    trl_value, trl_grad, _ = trl_loss(grpo, monkeypatch, inputs, batch)

    adv = streamrl_grpo_advantages(batch["rewards"], batch["group"], "group")
    assert_agree(inputs["advantages"], adv)
    settings = settings_for(BETA, {"loss.agg": loss_agg, "loss.clip_eps_high": 0.28, **streamrl_is})
    value, grad, _ = streamrl_loss(batch, adv, settings, behav=batch["behav"])
    assert_agree(value, trl_value)
    assert_agree(grad, trl_grad)
    # The correction acted: some weights were capped or masked.
    ratio = inputs["importance_sampling_ratio"]
    assert bool(((ratio == 0) | (ratio == 1.3)).any())


# -- RLOO loss ----------------------------------------------------------------------------------


def test_rloo_gradient_at_ratio_one(
    rloo: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLOO's sequence-ratio loss has streamrl's ppo + seq_mean_token_sum gradient at ratio 1
    (one optimizer step per batch); the values differ (see the module docstring)."""
    on_policy = {**batch, "old": batch["current"]}
    mask = batch["mask"]
    adv = batch["advantages"]
    inputs = {
        "prompt_ids": torch.full((B, 2), 5),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.full((B, T), 7),
        "completion_mask": mask.long(),
        "old_logps": (batch["current"] * mask).sum(1),
        "advantages": adv,
    }
    trl_value, trl_grad, _ = trl_loss(rloo, monkeypatch, inputs, on_policy)
    settings = settings_for(0.0, {"loss.agg": "seq_mean_token_sum", "loss.clip_eps_high": 0.28})
    value, grad, _ = streamrl_loss(on_policy, adv, settings)
    assert_agree(grad, trl_grad)
    assert_agree(trl_value, -adv.mean())
    assert_agree(value, -(mask.sum(-1) * adv).sum() / B)
