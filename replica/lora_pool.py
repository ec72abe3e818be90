"""The adapter pool: which LoRA adapters a replica knows (name -> folder) and which of them sit in its `max_loras`
weight slots now (no torch).

The scheduler asks the pool before it admits a sequence: an adapter already in a slot is shared; one that is not
takes a free slot or the least recently used slot no running sequence holds (LRU eviction). A sequence holds its
slot from admission until it finishes or is preempted, so the adapters of one batch always fit the slots. A slot
given to a new adapter is recorded as a load, which the next batch carries for every rank's model runner to read
before its forward pass (as it carries KV block copies)."""

from __future__ import annotations

from collections import OrderedDict


class UnknownAdapter(ValueError):
    """A request names an adapter the replica does not know (the service answers NOT_FOUND)."""


class AdapterInUse(ValueError):
    """An adapter cannot be unloaded while requests use it (the service answers FAILED_PRECONDITION)."""


class LoraPool:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._paths: dict[str, str] = {}  # every known adapter's folder
        self._slot: dict[str, int] = {}  # resident adapter -> slot
        self._holders: dict[str, int] = {}  # resident adapter -> sequences holding it
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident adapters nobody holds, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))  # slots never filled, or emptied by `remove`
        self._loads: list[tuple[int, str]] = []  # (slot, folder) to read before the next forward pass
        self.num_loads = 0  # adapters read into slots since start (metrics, tests)

    # ---- what is known ---------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._paths)

    def resident(self) -> list[str]:
        """Adapters in a slot now: a request for one runs without a load."""
        return list(self._slot)

    def path(self, name: str) -> str:
        if name not in self._paths:
            known = ", ".join(sorted(self._paths)) or "none"
            raise UnknownAdapter(f"unknown LoRA adapter {name!r}: this replica serves {known}")
        return self._paths[name]

    def add(self, name: str, path: str) -> None:
        """Registers an adapter (checked by the caller); a name already in use is refused."""
        if not name or "\0" in name:
            raise ValueError(f"a LoRA adapter needs a non-empty name without NUL characters, got {name!r}")
        if name in self._paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first or pick another name")
        self._paths[name] = path

    def remove(self, name: str) -> None:
        """Forgets an adapter; refused while running sequences hold it. Its slot becomes free."""
        self.path(name)
        if self._holders.get(name):
            raise AdapterInUse(
                f"LoRA adapter {name!r} is in use by {self._holders[name]} running sequences: retry later"
            )
        del self._paths[name]
        if name in self._slot:
            self._free.append(self._slot.pop(name))
            del self._holders[name]
            self._idle.pop(name, None)

    # ---- slots -----------------------------------------------------------------------------------------------
    def can_acquire(self, name: str) -> bool:
        """Whether a sequence of adapter `name` can be admitted now: it is resident, or a slot is free or idle."""
        return name in self._slot or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> int:
        """The slot of `name` for one more sequence, loading it (into a free slot, else the least recently used idle
        one) where it is not resident. Call only after `can_acquire`."""
        if name not in self._slot:
            if self._free:
                slot = self._free.pop()
            else:
                victim, _ = self._idle.popitem(last=False)
                slot = self._slot.pop(victim)
                del self._holders[victim]
            self._slot[name], self._holders[name] = slot, 0
            self._loads.append((slot, self._paths[name]))
            self.num_loads += 1
        self._idle.pop(name, None)
        self._holders[name] += 1
        return self._slot[name]

    def release(self, name: str) -> None:
        """One sequence of `name` no longer runs; with none left its slot may be evicted, least recently used first."""
        self._holders[name] -= 1
        if self._holders[name] == 0:
            self._idle[name] = None

    def drain_loads(self) -> list[tuple[int, str]]:
        """The (slot, folder) loads since the last drain, in order (a later one to the same slot wins)."""
        loads, self._loads = self._loads, []
        return loads
