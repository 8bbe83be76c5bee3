"""The cross-process debounce protocol over a revisioned key-value store.

:class:`KvDebounceBackend` implements :class:`~trio_debounce.abc.DebounceBackend` on any
:class:`~trio_debounce._kv.KvStore`; the rules are in :doc:`/protocol`. The modules:

* ``_documents``: what is stored (window documents, leases, fire records) and how.
* ``_rules``: the decisions on documents as read; pure.
* ``_backend``: :class:`KvDebounceBackend`, which does the I/O.

The names below are the ones the library and the tests import from here; the
underscored ones are the old names of the documents' types, kept for the tests.
"""

from ._backend import KvDebounceBackend as KvDebounceBackend
from ._documents import AFTER_KEEP as AFTER_KEEP
from ._documents import SWEEPER_KEY as SWEEPER_KEY
from ._documents import FireRecord as FireRecord
from ._documents import Lease as Lease
from ._documents import RunMarker as RunMarker
from ._documents import WindowDoc as WindowDoc
from ._documents import WindowFull as WindowFull
from ._documents import decode_lease as decode_lease
from ._documents import encode_lease as encode_lease

_AFTER_KEEP = AFTER_KEEP
_FireRecord = FireRecord
_Lease = Lease
_decode_lease = decode_lease
_encode_lease = encode_lease
