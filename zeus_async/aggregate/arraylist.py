"""A list backed by a numpy array, converted only where it is read.

:meth:`DeviceHistory.from_arrays <zeus_async.aggregate.history.DeviceHistory.from_arrays>`
builds the history of a whole recording at once: millions of samples per device. Its
estimators read a few values around each interval edge (a bisect, a fit over ~20 counter
points), so turning every value into a Python object up front (``ndarray.tolist``) costs far
more than any query. :class:`ArrayList` holds the array and gives what a ``list`` of
``array.tolist()`` would give, element by element: ``ndarray.item`` returns the same Python
``int``/``float`` as ``tolist``, so every figure computed from it is the same to the bit.
The first change (append, delete, assign) turns it into a real list, once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, MutableSequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["ArrayList"]

logger = logging.getLogger(__name__)

T = TypeVar("T", int, float)

#: Values converted at a time by iteration (bounded memory over any length).
_ITER_CHUNK = 65536


class ArrayList(MutableSequence[T], Generic[T]):
    """``list(array.tolist())`` without converting it: reading an element converts that one
    (``ndarray.item``: the same Python scalar ``tolist`` gives), a slice converts the slice,
    iteration converts a chunk at a time; changing it converts it all into a list, once.

    Args:
        array: A one-dimensional int64 or float64 array (not copied; not to be changed).
    """

    __slots__ = ("_array", "_list")

    def __init__(self, array: npt.NDArray[Any]) -> None:
        if array.ndim != 1:
            raise ValueError("ArrayList holds a one-dimensional array")
        self._array: npt.NDArray[Any] | None = array
        self._list: list[T] | None = None

    def _own(self) -> list[T]:
        """The values as a real list (converted on the first change)."""
        if self._list is None:
            assert self._array is not None
            self._list = self._array.tolist()
            self._array = None
        return self._list

    @property
    def array(self) -> np.ndarray[Any, Any] | None:
        """The backing array while unchanged (``None`` once converted into a list)."""
        return self._array

    def __len__(self) -> int:
        if self._list is not None:
            return len(self._list)
        assert self._array is not None
        return len(self._array)

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if self._list is not None:
            return self._list[i]
        assert self._array is not None
        if isinstance(i, slice):
            out: list[T] = self._array[i].tolist()
            return out
        value: T = self._array.item(i)  # IndexError outside, negative indices as a list's
        return value

    @overload
    def __setitem__(self, i: int, value: T) -> None: ...

    @overload
    def __setitem__(self, i: slice, value: Iterable[T]) -> None: ...

    def __setitem__(self, i: int | slice, value: Any) -> None:
        self._own()[i] = value

    def __delitem__(self, i: int | slice) -> None:
        del self._own()[i]

    def insert(self, index: int, value: T) -> None:
        self._own().insert(index, value)

    def append(self, value: T) -> None:
        self._own().append(value)

    def extend(self, values: Iterable[T]) -> None:
        self._own().extend(values)

    def __iter__(self) -> Iterator[T]:
        if self._list is not None:
            yield from self._list
            return
        array = self._array
        assert array is not None
        for at in range(0, len(array), _ITER_CHUNK):
            yield from array[at : at + _ITER_CHUNK].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ArrayList):
            other = other.tolist()
        if not isinstance(other, list):
            return NotImplemented
        return self.tolist() == other

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def tolist(self) -> list[T]:
        """A new list of the values."""
        if self._list is not None:
            return list(self._list)
        assert self._array is not None
        out: list[T] = self._array.tolist()
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        import numpy as np

        if self._array is not None:
            return np.array(self._array, dtype=dtype, copy=True if copy else None)
        return np.array(self._list, dtype=dtype)

    def __repr__(self) -> str:
        return f"ArrayList({self.tolist()!r})"
