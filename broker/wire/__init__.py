"""The wire format: the envelope, tensor encodings, the protocol's messages and the chunk frame format, with
the byte-level helpers they share (blobs: digests, zstd, byte planes; threads: the codec's thread pool;
malloc: the allocator tuning of services that move model-sized buffers; untrusted: how msgpack decodes bytes
from the network). No connection, no transport."""
