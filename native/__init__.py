"""The native cores: C for the step path's per-item passes, each optional, each with a Python pass.

``_stepcore`` (the step wire's codec: frames in, records out), ``_storecore`` (the store's
per-key loops) and ``_hotcore`` (the adapter wing's hot acquire and release). Nothing imports
them directly: ``memory_broker.proto.wire.native.load`` does, by the names it defines
(``STEPCORE``, ``STORECORE``, ``HOTCORE``), and answers None where one is off or not built.
"""
