"""Library-neutral machinery: the path of one compile through the cache.

The hook on ``cutlass.cute.compile`` (:mod:`.hook`), what describes a compile's arguments
(:mod:`.describe`), the ``Adapter`` record every library fills (:mod:`.adapter`), the
hit-or-compile policy (:mod:`.cache`), making an entry from a compiled kernel and calling a
loaded one as the compiled one was (:mod:`.export`, :mod:`.as_compiled`, :mod:`.convention`),
and what a serving process says (:mod:`.report`, :mod:`.ranks`). Nothing here names a library:
that knowledge lives in the adapters (``flashinfer_sites/``, ``b12x_sites/``).

This ``__init__`` imports nothing, so importing one module of the folder imports only that.
"""
