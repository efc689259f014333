"""Native chords: an atomic SQL counter per chord, each part counted once, fenced by its
delivery's lease."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import ChordError

from sqlease._core.results import FenceRefused
from sqlease.backend._fencing import (
    REFUSED,
    Counted,
    counted_part,
    counting_part,
    pending_expiries,
    writing_under,
)
from sqlease.types import Fence

logger = logging.getLogger(__name__)


class NativeChords(KeyValueStoreBackend):  # type: ignore[misc]
    """Chord counting for the sqlease result backend (a mixin of it)."""

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> Any:
        fence = self._fence_for(request)
        if fence is not None and getattr(request, REFUSED, False):
            return None  # its result was refused: it must not count towards the chord
        chord = getattr(request, "chord", None)
        token = writing_under.set((fence, str(request.id)) if fence else None)
        part = counting_part.set(str(request.id))
        expiries: list[tuple[str, float | None]] = []
        later = pending_expiries.set(expiries)
        counted = counted_part.set(None)
        size: int | None = None
        try:
            count = self._count_part(request, fence)
            if count is not None and count[1].settled:
                # A duplicate of a part already counted (the same task delivered twice, e.g.
                # a publish repeated by the app): Celery's base would restore the group
                # first, which is deleted once the chord fired, and fail the chord's body
                # with "GroupResult … no longer exists".
                logger.info(
                    "sqlease: chord part %s of group %s was counted already; not counted again",
                    request.id,
                    request.group,
                )
                return None
            if count is not None:
                counted_part.set(count)
                if (
                    count[1].size is not None
                    and isinstance(chord, dict)
                    and chord.get("chord_size") is None
                ):
                    size = count[1].size
                    request.chord = dict(chord, chord_size=size)  # Celery's base reads it here
            return super().on_chord_part_return(request, state, result, **kwargs)
        except FenceRefused:
            logger.warning("sqlease: chord part of task %s refused: its lease is gone", request.id)
            return None
        finally:
            counted_part.reset(counted)
            pending_expiries.reset(later)
            counting_part.reset(part)
            writing_under.reset(token)
            if size is not None:
                request.chord = chord
            if expiries:
                self.results.expire_many(expiries)

    def _count_part(self, request: Any, fence: Fence | None) -> Counted | None:
        """This part's count, in one transaction before Celery's base runs (which then reads
        it: ``incr``, ``expire``, ``_restore_group``), with what that transaction expired.
        None for a request that is no chord part (Celery's base returns at once)."""
        group, part = getattr(request, "group", None), getattr(request, "id", None)
        chord = getattr(request, "chord", None)
        if not group or not part or not chord:
            return None
        key = self._key(self.get_key_for_chord(group))
        expiries = self._part_expiries(key, group, str(part))
        expires = getattr(self, "expires", None)
        count = self.results.count_part(
            key,
            str(part),
            group_key=self._key(self.get_key_for_group(group)),
            size=_size_of(chord),
            fence=fence,
            task_id=str(part) if fence is not None else None,
            part_expires_ms=int(expires * 1000) if expires else None,
            expiries=expiries,
        )
        return key, count, frozenset(expiries) if count.expired else frozenset()

    def _part_expiries(
        self, chord_key: str, group: Any, part: str
    ) -> list[tuple[str, float | None]]:
        """What Celery's base expires after a count that did not complete the chord: since
        Celery 5.7 the counter, the saved header and the part's own result, each for as long
        as a chord's results are kept; before, the counter (``chord_key``) alone."""
        if not hasattr(type(self), "_chord_result_expires"):
            return [(chord_key, self.expires)]
        keep = self._chord_result_expires
        return [
            (chord_key, self.chord_expires),
            (self._key(self.get_key_for_group(group)), keep),
            (self._key(self.get_key_for_task(part)), keep),
        ]

    def _apply_chord_incr(self, header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        """A chord is applied: its counter starts afresh. A frozen chord applied again keeps
        its group id and its header's task ids, and each apply is a new run (Celery's suite,
        ``test_reapplying_frozen_chord_dispatches_body_again``): the parts counted by an
        earlier apply must not keep this one's from counting. (A part of the same apply
        delivered twice is still counted once.)"""
        group_id, parts = header_result_args[0], header_result_args[1]
        self.results.reset_counter(
            self._key(self.get_key_for_chord(group_id)), sorted(_part_ids(parts))
        )
        return super()._apply_chord_incr(header_result_args, body, **kwargs)

    def add_to_chord(self, chord_id: Any, result: Any) -> None:
        """Celery's ``Task.add_to_chord``: one more part the chord waits for, its result
        joined with the header's (after them) when the body is called."""
        expires = getattr(self, "expires", None)
        self.results.add_part(
            self._key(self.get_key_for_chord(chord_id)),
            str(result.id),
            expires_ms=int(expires * 1000) if expires else None,
        )

    def _restore_group(self, group_id: Any) -> Any:
        """The group as saved. While a part is counted (Celery's base restores the chord's
        header first, in every part, to join it in the last one), a stand-in that reads it
        only when it is used, with the parts added to the chord after it (``add_to_chord``):
        decoding a header of 1,000 results in each of its 1,000 parts made a chord's cost
        grow with the square of its size."""
        if counting_part.get() is None:
            return super()._restore_group(group_id)
        counted = counted_part.get()
        if counted is not None and counted[0] == self._key(self.get_key_for_chord(group_id)):
            found = counted[1].header  # the part's count read whether the header is saved
        else:
            found = self.results.exists(self._key(self.get_key_for_group(group_id)))
        if not found:
            return None  # Celery's base fails the chord: the group no longer exists
        return {"result": _LazyHeader(lambda: self._header(group_id))}

    def _header(self, group_id: Any) -> Any:
        meta = super()._restore_group(group_id)
        if meta is None:
            raise ChordError(f"GroupResult {group_id} no longer exists")
        group = meta["result"]
        added = self.results.added_parts(self._key(self.get_key_for_chord(group_id)))
        if added:
            results = list(group.results) + [self.app.AsyncResult(i) for i in added]
            group = self.app.GroupResult(group.id, results, app=self.app)
        return group

    def set_chord_size(self, group_id: Any, chord_size: int) -> None:
        """Celery calls this while publishing a chord's header, with the number of parts that
        will report: a nested group counts each of its tasks, where the restored header
        (Celery's fallback, ``len(deps)``) counts it once. Without it, a header such as
        ``group(a, chain(b, group(c, d)))`` fires its body after two parts of three and then
        joins a part that has not run. Stored in the results table under the chord counter's
        own key, so it is expired and deleted with the counter."""
        self._put(self.get_key_for_chord(group_id), str(int(chord_size)), None, fence=None)


class _LazyHeader:
    """A chord's header restored on first use (``NativeChords._restore_group``): Celery's base
    asks only whether it exists in all but the chord's last part, unless it must count it
    (no chord size known), which ``len`` reads."""

    __slots__ = ("_group", "_load")

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._group: Any = None

    def _loaded(self) -> Any:
        if self._group is None:
            self._group = self._load()
        return self._group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loaded(), name)

    def __len__(self) -> int:
        return len(self._loaded())

    def __iter__(self) -> Any:
        return iter(self._loaded())


def _size_of(chord: Any) -> int | None:
    """The chord size a part's request carries (Celery sets it when it publishes the
    header), None if none."""
    size = chord.get("chord_size") if isinstance(chord, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _part_ids(results: Any) -> set[str]:
    """The task ids that count towards a chord: its header's results, nested groups'
    results in full (a chain reports as its last task, whose result it is)."""
    ids: set[str] = set()
    for result in results or ():
        nested = getattr(result, "results", None)
        if nested is not None:
            ids |= _part_ids(nested)
        elif getattr(result, "id", None):
            ids.add(str(result.id))
    return ids
