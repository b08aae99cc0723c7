"""dynvm.cluster.protocol: the wire, as the replica and the proxy speak it: it imports
no other floor, but for one edge that tests/dynvm/test_layering.py lists (_generate
builds the generation scheduler's request type).

The v2 inference protocol's bodies, bounded and typed (_v2, _v2_json), HTTP errors and
routes (_http_errors, _http_front), gRPC (grpc_v2: the servicer a Serve config names),
the proxy's guard (proxy_guard: limits before buffering), ingress (proxy or direct),
loopback listeners (_loopback), the generation protocols' bodies (_generate) and the
seam between a transport and a replica (_seam: Fault, Encoder, InferSeam).
"""
