"""Agent RL: multi-turn episodes with tools on the same bus, staleness dial and weight sync as
single-turn runs (docs/agents.md).

`ledger` keeps each sample's tokens verbatim with the loss mask; `chat` renders turns and parses
tool calls (the built-in model's format and Qwen's Hermes format); `tools` turns Python functions
into tools with deadlines and limits, `code_tool` runs model-written code in the reward sandbox;
`episode` defines workflows and the built-in tool and environment loops; `scheduler` batches the
turns of many episodes into the engine; `runner` runs a batch of episodes; `role` is the rollout
role of an agent run.
"""
