"""The client's step path: what an engine does every step, and the calls that carry it.

``calls.py`` chooses a session's step calls: ``channel.py``'s ``ChannelCalls`` over the step
channel (``path.py``'s ``StepPath``: a frame a call; a running batch's changes, ``delta.py``), or
``grpc_calls.py``'s ``GrpcCalls``. ``transport.py`` is the channel's socket and framing,
``lease.py`` makes records into leases and objects (``adapters.py``: adapter leases and their
tables), and ``batch.py`` is ``StepBatch``. The client's own part that opens
the channel for a session is ``clients/step_session.py``; nothing here imports the client.
"""
