"""`flatshard train --sync-to HOST:PORT`: push the weights to the receivers of a weight-sync
group (an inference engine's processes, or `flatshard receive`) every `sync.interval` steps
and at the end, as `flatshard.sync_weights` streams them, and end the stream when the run
ends so the receivers stop waiting."""

from __future__ import annotations

import flatshard


class WeightPush:
    def __init__(self, config):
        sync = config.sync
        self.interval, self.delta, self.names = sync.interval, sync.delta, sync.names
        self.wire = None if sync.wire == "none" else sync.wire
        self.group = flatshard.weight_sync_group(sync.address, receivers=sync.receivers)
        self.last_step = None

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def push(self, model, step: int) -> dict:
        """Sync the weights after `step`; what it sent, for the step's metrics."""
        stats = flatshard.sync_weights(
            model, self.group, names=self.names, wire=self.wire, delta=self.delta, version=step
        )
        self.last_step = step
        return {"sync_bytes": stats.bytes_sent, "sync_s": stats.seconds}

    def finish(self, model, step: int) -> None:
        """The last weights (unless the last step's are out already), then the end."""
        if self.last_step != step:
            self.push(model, step)
        flatshard.end_weight_sync(self.group)
