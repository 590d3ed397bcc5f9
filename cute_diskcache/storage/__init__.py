"""The local store: where entries lie, what one is, who may write them, and their upkeep.

Lookup and atomic commit (:mod:`.store`), the artifact format (:mod:`.entry`, :mod:`.loader`,
:mod:`.elf`), the root's layout (:mod:`.layout`), trust and locks (:mod:`.trust`,
:mod:`.locking`), size cap and LRU (:mod:`.eviction`), counters (:mod:`.stats`), bounding
the rest (:mod:`.housekeeping`, :mod:`.staleness`), entries arriving from elsewhere
(:mod:`.ingest`, :mod:`.bundle`), second-stage records (:mod:`.reuse`) and why a key missed
(:mod:`.explain`).

This ``__init__`` imports nothing, so importing one module of the folder imports only that.
"""
