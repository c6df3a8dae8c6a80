"""Messaging: the wire format (broker.wire) and the transport that carries it (broker.transport).

broker.wire imports nothing of broker.transport: bytes in, bytes out, no connection.
"""
