"""The compute engine: activations that stay split between sharded layers, through the model's own code.

A Linear split on its output features (a *producer*: q/k/v, gate/up) computes only this
rank's slice of its output; a Linear split on its input features (a *consumer*: o_proj,
down_proj) needs only that slice. Between them runs ordinary model code: reshapes to heads,
rotary embeddings, attention masks, ``scaled_dot_product_attention``, grouped-query
``repeat_kv``. Run on the local slices, that code computes each rank's heads only, and a
decoder layer needs just the consumers' two all-reduces. Whether code may run on slices depends
on every op in it, so the engine follows the placements op by op, while the code runs.

The engine's stages, one module each:

* ``placements``: the four placements an activation can have (``Split``, ``Packed``,
  ``Strided``, ``Partial``: a pending sum), each with its moves (to whole, cut, add once) and
  the collectives they are made of, with their exact adjoints;
* ``rules``: the one table of rules, keyed by op, one rule per placement kind, and the
  ``Decision`` a rule returns; ``split``, ``packed``, ``pending``, ``strided`` and ``loss`` hold
  the rules themselves (``heads`` and ``conv`` those of linear attention's ops), ``shapes``
  the pure reshape planning they share, ``signatures`` how a call's arguments are named;
* ``dispatch``: the torch function mode of a zone, which sends every op on a placed
  activation to its rule through one bounded decision cache, or to the exact gathered
  fallback;
* ``state``: what the engine keeps per thread;
* ``zone``: how a zone's call runs (eager, and traced by ``torch.compile``), and
  ``loss_parallel``.

Which modules are zones is decided at shard time, outside the engine (``zone_plan``). The
engine never imports shard-time modules (``tests/test_layering.py``).
"""
