"""Graph models (model.graph: a torch.export program as the wire's GraphSpec), the engine's one concept that
spans files:

    ops.py          the allow-list: each ATen op a graph may call, and why the others are refused
    program.py      a compiled graph's steps and values, what the compiler emits and the interpreter runs
    compiler.py     GraphSpec checks -> the compiled graph (validate_graph, compile_graph); build_graph
    functions.py    custom autograd Functions: the user's forward and backward graphs as one Function
    interpreter.py  GraphModel: the compiled graph as an nn.Module whose forward runs the steps
    meta_check.py   a graph's shapes and sizes on the meta device, the dense kernels' workspace counted too
    batch_flow.py   which nodes mix a batch (micro-batches, per-sample gradients and shards need none)
    sparse.py       sparse inputs and weights (COO, CSR) decoded and checked, and their dense meta stand-ins

The prepare side of a graph request (GraphSpecModel) is prepare_graph.py, beside prepare_layers.py.
"""
