"""The feeder and the reward role are built, and do their work, in a process that never imports
torch (in Ray mode each role is such a process: torch's import is about 2 CPU-s of its start-up).

The check runs in a fresh interpreter: this test process has torch loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from streamrl.api.registry import role_spec

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import numpy as np

    from streamrl.api import fields as F
    from streamrl.bus.local import LocalBus
    from streamrl.config.loader import load_config
    from streamrl.models.loading import load_tokenizer
    from streamrl.api.registry import bus_consumers
    from streamrl.api.run import RunContext
    from streamrl.config.derived import bus_capacity_groups
    from streamrl.runtime.context import load_datasets
    from streamrl.runtime.ray_runtime import RoleActor  # the module a Ray role process loads
    from streamrl.runtime.roles import build_role
    from streamrl.weights.dcs import InProcessWeights

    model_dir, run_dir = sys.argv[1], sys.argv[2]
    cfg = load_config(["rollout.batch_prompts=2", "rollout.group_size=2", "data.num_eval=4"])
    train, evals, _ = load_datasets(cfg)
    ctx = RunContext(cfg=cfg, policy_dir=Path(model_dir), run_dir=Path(run_dir),
                     train_rows=train, eval_rows=evals)
    bus = LocalBus(capacity_groups=bus_capacity_groups(cfg))
    for consumer in bus_consumers(cfg):
        bus.register_consumer(consumer)
    feeder, reward = (build_role(name, ctx, bus, InProcessWeights(), start_step=0)
                      for name in ("feeder", "reward"))
    assert feeder.step()
    # The rollout's part, by hand: the task's answer format, right for half the rows.
    tokenizer = load_tokenizer(Path(model_dir))
    lease = bus.claim("rollout", [F.ANSWER], 16)
    bus.ack(lease.lease_id, writes={
        row["sample_id"]: {
            F.RESPONSE_IDS: np.asarray(tokenizer.encode(f"sum:{int(row[F.ANSWER]) + i % 2}"), np.int64),
            F.ROLLOUT_LOGPROBS: np.zeros(1, np.float32),
            F.VERSIONS: np.zeros(1, np.int64),
            F.FINISH_REASON: "stop",
        }
        for i, row in enumerate(lease.rows)
    })
    assert reward.step()
    scored = bus.claim("advantage", [F.REWARD], 16).rows
    reward.close()
    print(json.dumps({
        "rewards": sorted(row[F.REWARD] for row in scored), "torch": "torch" in sys.modules
    }))
    """
)


def test_feeder_and_reward_roles_never_import_torch(model_dir, tmp_path):
    assert {
        name for name in ("feeder", "reward", "rollout", "trainer") if role_spec(name).torchless
    } == {
        "feeder",
        "reward",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said == {"rewards": [0.0, 0.0, 1.0, 1.0], "torch": False}
