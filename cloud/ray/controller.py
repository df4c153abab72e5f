"""ReplicaController: the verifier replicas of one fleet as Ray actors, scaled to a count (by hand or by
the Autoscaler). A replica that goes is drained first: it leaves the router and its live sessions move to
the others (the same replay path as a failover), so scaling down loses no session. Runs as a named Ray
actor so that `specedge ray scale` from another shell finds it."""

from __future__ import annotations

import logging

from specedge.cloud.config import ServerConfig
from specedge.cloud.ray.autoscale import Autoscaler
from specedge.cloud.ray.replica import VerifierReplica

log = logging.getLogger("specedge.ray")

NAMESPACE = "specedge"
CONTROLLER = "specedge-controller"


class ReplicaController:
    def __init__(self, config: ServerConfig, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 autoscaler: Autoscaler | None = None) -> None:
        import ray

        self.config, self.autoscaler = config, autoscaler
        self._actor_class = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1)(VerifierReplica)
        self.replicas: list = []  # actor handles, oldest first

    def scale(self, count: int) -> list[str]:
        """Have `count` replicas, each serving; the addresses of those there are."""
        import ray

        if count < 0:
            raise ValueError(f"a replica count is >= 0, got {count}")
        while len(self.replicas) < count:
            self.replicas.append(self._actor_class.remote(self.config))
        if len(self.replicas) > count:
            # Those holding the fewest sessions go: fewer sessions to move.
            loads = ray.get([r.sessions.remote() for r in self.replicas])
            order = sorted(range(len(self.replicas)), key=lambda i: loads[i])
            leaving = {i for i in order[: len(self.replicas) - count]}
            gone = [self.replicas[i] for i in leaving]
            self.replicas = [r for i, r in enumerate(self.replicas) if i not in leaving]
            ray.get([r.drain.remote(self.config.grace_s) for r in gone])
            for r in gone:
                ray.kill(r)
        return ray.get([r.target.remote() for r in self.replicas])  # waits for new ones to serve

    def status(self) -> list[tuple[str, int]]:
        import ray

        return list(zip(ray.get([r.target.remote() for r in self.replicas]),
                        ray.get([r.sessions.remote() for r in self.replicas])))

    def autoscale(self, now: float) -> int:
        """One tick of the autoscaler (the `ray up` loop calls it every second); the replica count after it."""
        if self.autoscaler is None:
            return len(self.replicas)
        sessions = sum(n for _, n in self.status())
        want = self.autoscaler.desired(len(self.replicas), sessions, now)
        if want != len(self.replicas):
            log.info('{"event": "autoscale", "from": %d, "to": %d, "sessions": %d}', len(self.replicas), want,
                     sessions)
            self.scale(want)
        return len(self.replicas)

    def shutdown(self) -> None:
        self.scale(0)


def start_controller(config: ServerConfig, num_cpus: float, num_gpus: float, autoscaler: Autoscaler | None):
    """The fleet's controller as a named Ray actor (ray.init must have been called)."""
    import ray

    actor = ray.remote(num_cpus=0)(ReplicaController).options(name=CONTROLLER, namespace=NAMESPACE)
    return actor.remote(config, num_cpus, num_gpus, autoscaler)


def find_controller():
    import ray

    return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
