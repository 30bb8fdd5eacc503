"""SGLang 0.5.17's default CUDA-graph batch sizes up to 256
(ServerArgs._generate_decode_cuda_graph_batch_sizes): the lists a server at its defaults
captures, so the benches time the controller at the sizes it decides between there."""

SPEC_BS = (tuple(range(1, 9)) + tuple(range(10, 33, 2)) + tuple(range(40, 65, 4))
           + tuple(range(72, 257, 8)))
DECODE_BS = (1, 2, 4, 8, 12) + tuple(range(16, 257, 8))
