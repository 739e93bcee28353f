"""Checkpoints in host memory over several hosts (`save(host_local=True)`, `load(...)`).

Each host's directory (a RAM-backed one, such as /dev/shm) is its own: no other host sees
it. A save writes each rank's files on its own host, gives every host the shared ones (the
DCP metadata and the manifest) and commits the step there too; then each rank sends its
files to a rank on the next host (a ring), so a host that is lost with its memory leaves
a whole copy of its ranks' part on its neighbour. A load first brings every rank the files
its own reads need (DCP's load plan says which) from whichever host holds them; a step
counts as recoverable when the hosts still up hold every file of it between them (one host
lost, or two that are not neighbours).

Hosts are told apart by host name and directory: two agents on one machine given two
directories (as tests do) are two hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from flatshard.checkpoint import commit, manifest
from flatshard.checkpoint.state import barrier

_SHARED = (".metadata", manifest.MANIFEST)  # written once, by rank 0, on its host


@dataclass(frozen=True)
class Hosts:
    """Which host each rank of the checkpoint group is on (hosts in order of their lowest
    rank)."""

    of_rank: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.of_rank))

    def ranks_on(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.of_rank) if h == host]

    def leads(self, rank: int) -> bool:
        """Whether `rank` is its host's lowest: it makes and removes the host's directories."""
        return self.ranks_on(self.of_rank[rank])[0] == rank

    def ring_peer(self, rank: int) -> int | None:
        """The rank on the next host that keeps a copy of `rank`'s files (None: one host)."""
        names = self.names
        if len(names) == 1:
            return None
        here = self.of_rank[rank]
        there = self.ranks_on(names[(names.index(here) + 1) % len(names)])
        return there[self.ranks_on(here).index(rank) % len(there)]


def hosts_of(directory: str, group) -> Hosts:
    """Every rank's host (one all-gather; every rank calls it)."""
    return Hosts(tuple(_gathered(_host(directory), group)))


def _host(directory: str) -> str:
    return f"{socket.gethostname()}:{os.path.realpath(directory)}"


def spread(directory: str, step: int, group, hosts: Hosts, rank: int, keep_last) -> None:
    """After rank 0 committed `step` on its host: commit it on every other host too (with
    the shared files), send each rank's files to its ring peer, and only then drop the
    older steps (a failure on the way leaves the previous snapshot whole). Every rank
    calls it."""
    if len(hosts.names) > 1:
        committed = os.path.join(directory, commit.step_dir_name(step))
        shared = [_read(os.path.join(committed, n)) if rank == 0 else None for n in _SHARED]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        if hosts.leads(rank) and hosts.of_rank[rank] != hosts.of_rank[0]:
            partial = commit.partial_dir(directory, step)
            for name, data in zip(_SHARED, shared):
                commit.write_durably(os.path.join(partial, name), data)
            commit.commit(directory, step)
        barrier(group)  # every host has committed the step
        files = manifest.read(committed)["files"]
        ring = [
            (source, hosts.ring_peer(source), name)
            for source in range(len(hosts.of_rank))
            for name in sorted(files)
            if _written_by(name, source)
        ]
        _exchange(committed, ring, files, group, rank)
        barrier(group)  # the copies are whole before any older step goes
    if keep_last and hosts.leads(rank):
        commit.prune(directory, keep_last)
    barrier(group)  # the save is done when every host holds what it will


def recoverable_step(directory: str, group) -> int | None:
    """The newest step whose files the hosts hold between them, every one whole (every rank
    calls it; None: none)."""
    everyone = _gathered(_held(directory), group)
    for step in sorted({step for each in everyone for step in each}, reverse=True):
        holding = [each[step] for each in everyone if step in each]
        if holding[0][0] <= set().union(*(whole for _, whole in holding)):
            return step
    return None


def bring_shared(directory: str, step: int, group, rank: int) -> str:
    """Give this rank's host the committed `step`'s shared files (a host that lost its
    memory has none) from a host that holds them; returns the step's path. Every rank calls
    it, then `bring_read`."""
    path = os.path.join(directory, commit.step_dir_name(step))
    if group is None:
        return path
    where = _host(directory)
    offers = _gathered((where, _has_shared(path)), group)
    if all(has for _, has in offers):
        return path
    holder = [has for _, has in offers].index(True)
    shared = [_read(os.path.join(path, n)) if rank == holder else None for n in _SHARED]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, holder), group=group)
    if offers.index(offers[rank]) == rank and not offers[rank][1]:  # one rank of the host
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
        for name, data in zip(_SHARED, shared):
            commit.write_durably(os.path.join(path, name), data)
    barrier(group)
    return path


def bring_read(path: str, read: list[str], group, rank: int) -> None:
    """Fetch the files of `read` (those this rank's load reads) that its host lacks from the
    hosts that hold them (once per host and file). Every rank calls it."""
    if group is None:
        return
    directory, step = os.path.dirname(path), commit.step_of(path)
    have = _held(directory).get(step, (set(), set()))[1]
    everyone = _gathered((_host(directory), sorted(set(read) - have), have), group)
    transfers, planned = [], set()
    for receiver, (host, asks, _) in enumerate(everyone):
        for name in asks:
            holders = [r for r, (_, _, held) in enumerate(everyone) if name in held]
            if (host, name) not in planned and holders:
                planned.add((host, name))
                transfers.append((holders[0], receiver, name))
    _exchange(path, transfers, manifest.read(path)["files"], group, rank)
    barrier(group)  # what a host fetched is there for its other ranks too


def drop_after(directory: str, step: int | None) -> None:
    """Remove this host's steps newer than `step` (None: all): a run going on from `step`
    saves them anew. Any rank may call it (before its next save)."""
    for newer in commit.committed_steps(directory):
        if step is None or newer > step:
            shutil.rmtree(os.path.join(directory, commit.step_dir_name(newer)), ignore_errors=True)
    marked = commit.latest_dir(directory)
    if marked is not None and not os.path.isdir(marked):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, commit.LATEST))


def files_read(path: str, state: dict, rank: int) -> list[str]:
    """The files of checkpoint `path` a load of `state` on `rank` reads: those DCP's own load
    plan names, and the rank's RNG state."""
    metadata = FileSystemReader(path).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    names = {metadata.storage_data[item.storage_index].relative_path for item in plan.items}
    rng = os.path.join("rng", f"rank{rank}.pt")
    return sorted(names | ({rng} if os.path.exists(os.path.join(path, rng)) else set()))


def _held(directory: str) -> dict[int, tuple[set[str], set[str]]]:
    """{step: (the files its manifest lists, those this host holds whole by size)} of the
    committed steps here."""
    held = {}
    for step in commit.committed_steps(directory):
        path = os.path.join(directory, commit.step_dir_name(step))
        if not os.path.isfile(os.path.join(path, manifest.MANIFEST)):
            continue
        files = manifest.read(path)["files"]
        whole = {n for n, info in files.items() if _size(os.path.join(path, n)) == info["size"]}
        held[step] = (set(files) | set(_SHARED), whole | set(_SHARED))
    return held


def _exchange(path: str, transfers: list, files: dict, group, rank: int) -> None:
    """Carry out (sender, receiver, file) transfers, all at once (every rank is given the
    same list and posts its own sends and receives, tagged by their place in it)."""
    posted, received = [], []
    for tag, (sender, receiver, name) in enumerate(transfers):
        if sender == receiver or rank not in (sender, receiver):
            continue
        if files[name]["size"] == 0:  # a rank that writes nothing (a replica's): no message
            if rank == receiver:
                received.append((name, torch.empty(0, dtype=torch.uint8)))
            continue
        if rank == sender:
            data = torch.frombuffer(bytearray(_read(os.path.join(path, name))), dtype=torch.uint8)
            peer = dist.get_global_rank(group, receiver)
            posted.append((dist.isend(data, peer, group=group, tag=tag), data))
        else:
            data = torch.empty(files[name]["size"], dtype=torch.uint8)
            peer = dist.get_global_rank(group, sender)
            posted.append((dist.irecv(data, peer, group=group, tag=tag), data))
            received.append((name, data))
    for work, _ in posted:
        work.wait()
    for name, data in received:
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        commit.write_durably(os.path.join(path, name), data.numpy().tobytes())


def _gathered(value, group) -> list:
    if group is None:
        return [value]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _has_shared(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _SHARED)


def _written_by(name: str, rank: int) -> bool:
    return name.startswith(f"__{rank}_") or name == os.path.join("rng", f"rank{rank}.pt")


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None
