"""The `runtime` section of the configuration: where and how a run's roles run (Ray placement,
restarts, health checks) and how weights reach the engines. Part of `streamrl.config.schema`,
which re-exports every name here. Imports no torch or Ray.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.section import Section


class RolePlacement(Section):
    num_cpus: float = Field(0.0, ge=0)
    """Ray logical CPUs reserved per replica (0: none; on one machine the roles share the cores)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per replica (fractions share a GPU)."""
    replicas: int = Field(1, ge=1)
    """Replicas of this role, all claiming from the bus (rollout, reward, reference, logp)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per replica, e.g. {node_a: 0.1} to land on the node that has them."""
    node: str | None = None
    """Pin the role to the Ray node with this node id or IP address (None: anywhere)."""


SCALABLE_ROLES = ("rollout", "reward", "judge", "reference", "logp")


class RolesConfig(Section):
    feeder: RolePlacement = RolePlacement()
    """Placement of the feeder."""
    rollout: RolePlacement = RolePlacement()
    """Placement of the rollout engines (several replicas share the work; see `streamrl scale`)."""
    reward: RolePlacement = RolePlacement()
    """Placement of the reward service."""
    judge: RolePlacement = RolePlacement()
    """Placement of the judge (when reward.judge.enabled): its engine's GPUs and CPUs."""
    reference: RolePlacement = RolePlacement()
    """Placement of the reference model (when algorithm.kl.coef > 0)."""
    logp: RolePlacement = RolePlacement()
    """Placement of the pi_old role (when algorithm.off_policy.proximal is pi_old)."""
    advantage: RolePlacement = RolePlacement()
    """Placement of the advantage role."""
    critic: RolePlacement = RolePlacement()
    """Placement of the critic (PPO)."""
    trainer: RolePlacement = RolePlacement()
    """Placement of the trainer."""

    @model_validator(mode="after")
    def _one_replica_for_stateful_roles(self) -> RolesConfig:
        for name in type(self).model_fields:
            if name not in SCALABLE_ROLES and getattr(self, name).replicas != 1:
                raise ValueError(
                    f"runtime.ray.roles.{name}.replicas must be 1; only {', '.join(SCALABLE_ROLES)} "
                    "can have several replicas"
                )
        return self


class PlacementGroupConfig(Section):
    strategy: Literal["none", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "none"
    """Ray mode: reserve one bundle per role replica (its num_cpus, num_gpus and resources; at
    least 0.01 CPU) in one Ray placement group with this strategy, and start each replica in its
    bundle (a restarted one goes back into it). none: no group, each actor scheduled on its own.
    Excludes `runtime.ray.roles.<role>.node`; steer bundles with custom resources instead."""
    timeout_s: float = Field(300.0, gt=0)
    """Ray mode: how long to wait for the cluster to reserve the group before the run fails."""


class RayConfig(Section):
    """Ray mode: the cluster, the roles' placement, the bus's shards and the supervision."""

    address: str | None = None
    """Address of an existing Ray cluster; None starts a local instance."""
    num_cpus: int | None = None
    """Logical CPUs of the local Ray instance (None: Ray's default)."""
    roles: RolesConfig = RolesConfig()
    """Ray mode: resources, replicas and node of each role."""
    placement_group: PlacementGroupConfig = PlacementGroupConfig()
    """Ray mode: reserve the roles' resources together in a Ray placement group."""
    bus_shards: int = Field(1, ge=1)
    """Ray mode: actors the bus's row metadata is spread over (groups hashed to shards). One is
    fastest on a single machine; more only help when one bus actor's core is the bottleneck."""
    max_restarts: int = Field(3, ge=0)
    """Ray mode: restarts allowed per role before the run fails (the trainer resumes from its
    latest checkpoint; the others restart in place)."""
    trainer_recovery: Literal["in_place", "restart_all"] = "in_place"
    """Ray mode: a lost trainer resumes from its latest checkpoint alone while the other roles
    keep running (in_place; the bus then keeps the rows trained since the last checkpoint, up
    to `trainer.checkpoint_every` batches more; a lost bus shard is rebuilt the same way, Ray
    restarting it and the trainer resuming), or every role restarts with it (restart_all;
    also what in_place falls back to with trainer.checkpoint_every=0)."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Ray mode: wait before a role's n-th restart is this times 2^(n-1)."""
    health_interval_s: float = Field(5.0, gt=0)
    """Ray mode: how often each role is pinged."""
    health_timeout_s: float = Field(120.0, gt=0)
    """Ray mode: a role that does not answer a ping this long is killed and restarted."""

    @model_validator(mode="after")
    def _placement_group_or_node(self) -> RayConfig:
        if self.placement_group.strategy == "none":
            return self
        for name in type(self.roles).model_fields:
            node = getattr(self.roles, name).node
            if node is not None:
                raise ValueError(
                    f"runtime.ray.roles.{name}.node={node!r} and runtime.ray.placement_group.strategy="
                    f"{self.placement_group.strategy} exclude each other: the placement group "
                    "chooses the nodes. Drop one, or steer the bundle with a custom resource "
                    "(runtime.ray.roles.<role>.resources)"
                )
        return self


class WeightsConfig(Section):
    """Ray mode: the weight channel from the trainer to the engines (DCS)."""

    channel: Literal["object_store", "tcp", "collective"] = "object_store"
    """Ray mode: how weights reach the engines: Ray's object store (one machine, or a cluster
    with a fast object store); a TCP weight server in the trainer process that streams
    safetensors buckets to each engine (any network; authenticated with `token`); or a
    torch.distributed broadcast (gloo, or NCCL: `collective_backend`) from the trainer to
    the engines, with a host copy in the object store for engines that (re)join (joining
    takes `token`; the broadcast itself is not authenticated: trusted networks)."""
    bind: str = "127.0.0.1"
    """tcp: address the trainer's weight server listens on; anything but loopback needs
    `token` (or $STREAMRL_WEIGHT_TOKEN). collective: the rendezvous address engines
    connect to, the only one it listens on: loopback (only engines on the trainer's node join
    the group; the others use the host copy), an address of the trainer's node, or 0.0.0.0 for
    its Ray node address; anything but loopback needs `token`."""
    port: int = Field(0, ge=0, le=65535)
    """tcp: port of the weight server (0: any free port). collective: first of 16 rendezvous
    ports taken in turn by successive groups (0: a free port for each)."""
    collective_backend: Literal["gloo", "nccl"] = "gloo"
    """collective: torch.distributed backend of the weight group: gloo (CPU tensors, any
    machine) or nccl (GPU to GPU; the trainer and every engine need a GPU, and an engine that
    cannot join receives the host copy instead)."""
    max_connections: int = Field(64, ge=1)
    """tcp: most connections the trainer's weight server holds at once (a thread each; every
    role process keeps one). Past it a connection is refused with a message naming this key and
    the client retries; a closed or dropped one frees its slot. collective: the same cap on the
    group's rendezvous store (one connection per engine)."""
    token: str | None = Field(None, json_schema_extra={"secret": True})
    """tcp and collective channels: shared secret clients (engines joining the group) must
    prove they hold (None: $STREAMRL_WEIGHT_TOKEN).
    A secret: never written to the run's config.yaml, so a resumed run (`--resume`) needs it
    again, from $STREAMRL_WEIGHT_TOKEN or `runtime.weights.token=...` on the command line."""


class RuntimeConfig(Section):
    mode: Literal["ray", "threads", "inline", "sync"] = "ray"
    """ray: every role its own process on Ray; threads: every role a thread of one process, the
    roles' kernels on different cores at once, no restarts (small models on few cores, where
    Ray's per-call costs are a large share of a step); inline: every role takes turns in one
    thread of one process (debugging, tests); sync: generate then train, in turn, in one process
    (the baseline)."""
    ray: RayConfig = RayConfig()
    """Ray mode: the cluster, placement, bus shards and supervision."""
    weights: WeightsConfig = WeightsConfig()
    """Ray mode: how weights reach the engines."""
    sync_threads: int | None = None
    """torch threads in sync mode (None: every core, as a synchronous loop would use)."""
    lease_s: float = Field(120.0, gt=0)
    """How long a role holds claimed rows before they are handed out again."""
    poll_s: float = Field(0.002, gt=0)
    """How long an idle role first waits before looking for work again (doubling while idle,
    up to 16x)."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Stop the run with a diagnosis when no training step finishes for this long."""
    claim_wait_s: float = Field(0.05, ge=0)
    """Ray mode: an empty claim waits up to this long inside the bus for matching rows (long
    poll), instead of polling across processes. The rollout and the trainer use this wait:
    what the rollout may claim also depends on the policy version, which the bus does not see."""
    idle_wait_s: float = Field(1.0, ge=0)
    """Ray mode: the same long poll for the roles whose work depends on the bus alone (reward,
    reference, advantage), and the feeder's wait for the policy version that admits its next
    batch. The change that gives them work wakes them at once, so a longer wait only means
    fewer empty round trips; it also bounds how long such a role takes to notice a stop."""
