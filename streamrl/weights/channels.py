"""Which weight channel a run uses, and the handle each role gets: the runtime's one entry point
into `weights/`.

```
 driver   publisher = publisher_for(cfg)  ──────────────────────────►  trainer process: publish
          trainer_info = {node, **publisher_info(trainer's handle)}  ◄──  (asked once it started)
          subscriber_for(cfg, publisher, trainer_info)  ────────────►  every other role process
          restarted_publisher(cfg, publisher, trainer_info)  ───────►  a trainer restarted in place
```

| mode, `runtime.weights.channel` | publisher                    | subscriber                    |
| ------------------------------- | ---------------------------- | ----------------------------- |
| inline, threads, sync           | `InProcessWeights`           | the publisher itself          |
| ray, `object_store`             | `RayWeights` (a store actor) | the publisher itself          |
| ray, `tcp`                      | `TcpPublisher` (its server)  | `TcpSubscriber` (a client)    |
| ray, `collective`               | `CollectivePublisher`        | `CollectiveSubscriber`        |

Handles are made in the driver and pickled into the role processes; a tcp server or a broadcast
group starts in the trainer's process on its first use. Imports are lazy, and the subscribers'
`latest_version` and `wait_newer` need no torch: the feeder and reward processes never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.api.weights import WeightPublisher, WeightSubscriber
    from streamrl.config.schema import Config


def publisher_for(cfg: Config) -> WeightPublisher:
    """The handle the trainer publishes to: in-process outside Ray mode, else the configured
    `runtime.weights.channel`. Called once per run, in the driver."""
    if cfg.runtime.mode != "ray":
        from streamrl.weights.dcs import InProcessWeights

        return InProcessWeights()
    weights = cfg.runtime.weights
    if weights.channel == "tcp":
        from streamrl.weights.remote import TcpPublisher, resolve_token

        return TcpPublisher(
            weights.bind,
            weights.port,
            resolve_token(weights.token),
            max_connections=weights.max_connections,
        )
    if weights.channel == "collective":
        from streamrl.weights.collective_channel import CollectivePublisher, GroupDirectory
        from streamrl.weights.remote import resolve_token
        from streamrl.weights.tcp import require_token_beyond_loopback

        token = resolve_token(weights.token)
        # before the directory actor exists: a refused bind leaves nothing behind
        require_token_beyond_loopback(weights.bind, token, "serve the weight-sync group")
        return CollectivePublisher(
            GroupDirectory.create(),
            weights.bind,
            weights.port,
            backend=weights.collective_backend,
            token=token,
            max_connections=weights.max_connections,
        )
    from streamrl.weights.dcs import RayWeights

    return RayWeights.create()


def publisher_info(publisher: WeightPublisher) -> dict[str, Any]:
    """What the trainer's process reports about its publisher for `subscriber_for` and
    `restarted_publisher`: the port its tcp weight server got (starting the server), else
    nothing. Called in the trainer's process; any other role's handle gives {}."""
    from streamrl.weights.remote import TcpPublisher

    if isinstance(publisher, TcpPublisher):
        return {"weights_port": publisher.address[1]}
    return {}


def subscriber_for(
    cfg: Config, publisher: WeightPublisher, trainer_info: dict[str, Any]
) -> WeightSubscriber:
    """The handle every other role reads weights from: the publisher itself where the store is
    shared (in-process, object store), a client of the trainer's weight server (tcp: needs
    `trainer_info` with "weights_port", and "node" unless it serves on loopback), a group member
    (collective)."""
    channel = cfg.runtime.weights.channel if cfg.runtime.mode == "ray" else "in_process"
    if channel == "collective":
        from streamrl.weights.collective_channel import CollectivePublisher, CollectiveSubscriber

        assert isinstance(publisher, CollectivePublisher), type(publisher)
        return CollectiveSubscriber(publisher.directory, token=publisher.token)
    if channel != "tcp":
        return publisher  # one store serves both sides
    from streamrl.weights.remote import TcpPublisher, TcpSubscriber
    from streamrl.weights.tcp import is_loopback

    assert isinstance(publisher, TcpPublisher), type(publisher)
    host = "127.0.0.1" if is_loopback(publisher.host) else trainer_info["node"]
    return TcpSubscriber(host, trainer_info["weights_port"], publisher.token)


def restarted_publisher(
    cfg: Config, publisher: WeightPublisher, trainer_info: dict[str, Any]
) -> WeightPublisher:
    """The handle a trainer restarted in place publishes to: the same one, except that a tcp
    weight server binds the port the first one got (from `trainer_info`), where the engines'
    subscribers reconnect. A collective publisher starts a new group epoch on its own."""
    if cfg.runtime.mode != "ray" or cfg.runtime.weights.channel != "tcp":
        return publisher
    from streamrl.weights.remote import TcpPublisher

    assert isinstance(publisher, TcpPublisher), type(publisher)
    return TcpPublisher(
        publisher.host,
        trainer_info["weights_port"],
        publisher.token,
        max_connections=publisher.max_connections,
    )
