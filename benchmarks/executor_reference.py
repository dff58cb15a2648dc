"""The bare multi-device executor the graph-mode targets are measured
against (issue 20, facts 1 and 5): written here from MXNet's own API,
independently of gluon_parallel's graph mode.

*graph+BN*: the hybridized network's traced symbol, once per device (its
variables renamed per replica, every node on that replica's device group),
with a ``SoftmaxOutput`` loss on each replica, bound by one
``Symbol.bind(..., group2ctx=...)`` directly to every Parameter's own
per-context data and gradient arrays, the running statistics as auxiliary
states (no copies). A step is ``forward(is_train=True)``, ``backward()``,
the gradients marked fresh, and the same ``gluon.Trainer.step`` as every
other contender.

*graph+BN+edges*: the same, with one negligible cross-device dependency
per BatchNorm layer in forward and backward: each replica sums one sample
of the layer's input, and every replica adds all replicas' sums, times 0,
to its gamma. What that costs is the lockstep floor of any exact
SyncBatchNorm on the machine, whatever computes the statistics.
"""
import json

__all__ = ['executor_step', 'replicated_symbol']


def _op(nodes, op, name, group, inputs, **attrs):
    """Append an operator on device group `group`; its first output."""
    attrs = {k: str(v) for k, v in attrs.items()}
    attrs['__ctx_group__'] = f'dev{group:d}'
    nodes.append({'op': op, 'name': name, 'attrs': attrs, 'inputs': inputs})
    return [len(nodes) - 1, 0, 0]


def _replica(g, nodes, r, param_names, loss=True):
    """Append replica r of graph `g` to `nodes`, with its SoftmaxOutput
    (`loss`); returns (its head, its BatchNorm node ids)."""
    base, batchnorms = len(nodes), []
    for node in g['nodes']:
        node = dict(node, attrs=dict(node.get('attrs', {})),
                    inputs=[[base + e[0], e[1], e[2]] for e in node['inputs']])
        name = node['name']
        if node['op'] == 'null' and (name in param_names or name == 'data'):
            node['name'] = f'{name}_r{r:d}'       # bound to replica r's arrays
        else:
            node['name'] = f'r{r:d}_{name}'
        if node['op'] != 'null' or name == 'data':     # (parameters: placed by binding)
            node['attrs']['__ctx_group__'] = f'dev{r:d}'
        nodes.append(node)
        if node['op'] == 'BatchNorm':
            batchnorms.append(len(nodes) - 1)
    head = g['heads'][0]
    head = [base + head[0], head[1], head[2]]
    if not loss:
        return head, batchnorms
    label = len(nodes)
    nodes.append({'op': 'null', 'name': f'softmax_label_r{r:d}', 'inputs': [],
                  'attrs': {'__ctx_group__': f'dev{r:d}'}})
    return _op(nodes, 'SoftmaxOutput', f'r{r:d}_softmax', r, [head, [label, 0, 0]]), batchnorms


def _add_edges(nodes, batchnorms):
    """Layer k of every replica r: gamma + 0 x (sum over replicas q of one
    sample of q's input of layer k): a forward and a backward edge between
    every pair of devices, per layer."""
    n = len(batchnorms)
    sums = [[_op(nodes, 'sum', f'r{r:d}_edge{k:d}_sum', r,
                 [_op(nodes, 'slice_axis', f'r{r:d}_edge{k:d}_slice', r,
                      [nodes[nid]['inputs'][0]], axis=0, begin=0, end=1)])
             for k, nid in enumerate(bns)] for r, bns in enumerate(batchnorms)]
    for r, bns in enumerate(batchnorms):
        for k, nid in enumerate(bns):
            total = _op(nodes, 'add_n', f'r{r:d}_edge{k:d}_total', r,
                        [sums[q][k] for q in range(n)], num_args=n)
            zero = _op(nodes, '_mul_scalar', f'r{r:d}_edge{k:d}_zero', r, [total], scalar=0)
            nodes[nid]['inputs'][1] = _op(nodes, 'broadcast_add', f'r{r:d}_edge{k:d}_gamma',
                                          r, [nodes[nid]['inputs'][1], zero])


def replicated_symbol(mx, sym, param_names, n, edges, loss=True):
    """`n` replicas of `sym`, each with its SoftmaxOutput (`loss`), on
    device groups dev0 ... dev{n-1}: variables ``data_r{i}``,
    ``softmax_label_r{i}`` and ``{parameter}_r{i}``."""
    g = json.loads(sym.tojson())
    nodes, heads, batchnorms = [], [], []
    for r in range(n):
        head, bns = _replica(g, nodes, r, param_names, loss)
        heads.append(head)
        batchnorms.append(bns)
    if edges:
        _add_edges(nodes, batchnorms)
    graph = {'nodes': nodes, 'heads': heads, 'attrs': g.get('attrs', {}),
             'arg_nodes': [i for i, node in enumerate(nodes) if node['op'] == 'null'],
             'node_row_ptr': list(range(len(nodes) + 1))}
    return mx.sym.load_json(json.dumps(graph))


def executor_step(mx, net, ctx, x, y, trainer, batch, edges=False):
    """One training step of the reference on `ctx` (see the module); with
    `y` None and no `trainer`: forward, and backward from head gradients
    of ones (the network's outputs themselves are the heads)."""
    from mxnet import gluon, nd
    from gluon_parallel import _gluon
    net.hybridize()
    net(x[:2].as_in_context(ctx[0]))
    params = {p.name: p for p in net.collect_params().values()}
    sym = replicated_symbol(mx, net(mx.sym.var('data')), set(params), len(ctx), edges,
                            loss=y is not None)
    xs = gluon.utils.split_and_load(x, ctx, even_split=False)
    ys = gluon.utils.split_and_load(y, ctx, even_split=False) if y is not None else None
    aux_names = set(sym.list_auxiliary_states())
    args, grads, aux, req = {}, {}, {}, {}
    for name in sym.list_arguments() + sym.list_auxiliary_states():
        base, r = name.rsplit('_r', 1)
        r = int(r)
        if base == 'data':
            args[name] = xs[r]
        elif base == 'softmax_label':
            args[name] = ys[r]
        elif name in aux_names:
            aux[name] = params[base].data(ctx[r])
        else:
            p = params[base]
            args[name] = p.data(ctx[r])
            if p.grad_req != 'null':
                grads[name], req[name] = p.grad(ctx[r]), 'write'
            else:
                req[name] = 'null'
    for name in args:
        req.setdefault(name, 'null')
    exe = sym.bind(ctx[0], args, args_grad=grads, grad_req=req, aux_states=aux,
                   group2ctx={f'dev{r:d}': c for r, c in enumerate(ctx)})
    trained = [p for p in params.values() if p.grad_req != 'null']
    ones = None if y is not None else [nd.ones(o.shape, ctx=o.context) for o in exe.outputs]

    def step():
        exe.forward(is_train=True)
        exe.backward(ones)
        if trainer is None:
            return
        for p in trained:
            for g in p.list_data():
                _gluon.set_grad_fresh(g, True)
        trainer.step(batch)
    return step
