"""The shard's gRPC edge: the servicer (service.py: validate, translate, hand off), who is admitted
(admission.py), the slots a call holds before its request arrives (slots.py), what a session sends and
what it is sent (intake.py, outbox.py), shard 0's Pieces calls (pieces.py), the shard that waits for its
first upload (initialize.py) and the sizes of its traffic (wiring.py).
"""
