"""Names of the sample fields that travel on the bus, and which role writes each.

| field | written by | value |
| --- | --- | --- |
| prompt_ids, answer, extra | feeder | token ids; reference answer; reward kwargs |
| media | feeder (a vision-language policy) | {key, store}: where the prompt's preprocessed media are (`streamrl.media.prepare`), or None for a text prompt |
| response_ids, rollout_logprobs, versions, finish_reason | rollout | token ids; per-token log-prob and policy version; "stop" or "length" |
| routed_experts | rollout (`algorithm.routing_replay=rollout`) | uint8 [positions, MoE layers, k]: the experts the engine routed each prompt and response position to (all but the last token's), under the policy version that produced it |
| loss_mask, episode | rollout (agent runs only) | 1 on model-sampled tokens, 0 on tool / environment / template tokens; the episode's outcome (final answer, status, turns, tool calls, workflow reward) |
| judge | judge (`reward.judge.enabled`) | {value: float or None, status, reason, verdict: the label or score read, reply: the judge's text} |
| reward, reward_status, reward_reason, reward_components | reward | float or None; ok / invalid_output / timeout / infra_error; text; {name: float} (logged only) |
| ref_logprobs | reference | per-token log-probs under the reference model |
| old_logprobs, old_version | logp (pi_old) | per-token log-probs under the newest published policy; its version |
| values | critic | per-token value estimates |
| advantages | advantage | a float per sample (broadcast over its tokens), a float per token (REINFORCE++, GAE), or None (dropped by dynamic sampling) |
| returns | advantage | per-token GAE returns (the critic's targets) |
"""

PROMPT_IDS = "prompt_ids"
ANSWER = "answer"
EXTRA = "extra"
MEDIA = "media"
RESPONSE_IDS = "response_ids"
ROLLOUT_LOGPROBS = "rollout_logprobs"
VERSIONS = "versions"
FINISH_REASON = "finish_reason"
ROUTED_EXPERTS = "routed_experts"
LOSS_MASK = "loss_mask"
EPISODE = "episode"
JUDGE = "judge"
REWARD = "reward"
REWARD_STATUS = "reward_status"
REWARD_REASON = "reward_reason"
REWARD_COMPONENTS = "reward_components"
REF_LOGPROBS = "ref_logprobs"
ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
OLD_VERSION = "old_version"
VALUES = "values"
RETURNS = "returns"

ROLLOUT_OUTPUTS = (RESPONSE_IDS, ROLLOUT_LOGPROBS, VERSIONS, FINISH_REASON)
REWARD_OUTPUTS = (REWARD, REWARD_STATUS, REWARD_REASON, REWARD_COMPONENTS)


# Group ids: the feeder names each group of a batch, refill rounds of dynamic sampling apart; the
# bus's batch collector reads the round back.
def group_id(batch_index: int, prompt: int, round_index: int = 0) -> str:
    """Group id of prompt `prompt` of round `round_index` of batch `batch_index`."""
    if round_index == 0:
        return f"b{batch_index}-p{prompt}"
    return f"b{batch_index}-r{round_index}-p{prompt}"


def group_round(group_id: str) -> int:
    """The refill round a group id belongs to (0 for the feeder's own batch)."""
    parts = group_id.split("-")
    return int(parts[1][1:]) if len(parts) == 3 and parts[1].startswith("r") else 0
