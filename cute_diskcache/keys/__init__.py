"""What decides the compiled bytes: the canonical key and the environment it is made of.

The key (:mod:`.key`), device profiles (:mod:`.targets`), the device facts a compile read
(:mod:`.devicefacts`), the host an object needs (:mod:`.hostcpu`, :mod:`.hostmachine`), which arch runs on which
capability (:mod:`.arch`), the live GPU as the driver sees it (:mod:`.gpu`), and
the digest of what a compile lowered, for the second-stage key (:mod:`.trace`).

This ``__init__`` imports nothing, so importing one module of the folder imports only that.
"""
