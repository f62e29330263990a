"""Framework adapters: they convert, never reimplement.

Not a package of its own once installed: ``bindings/torch`` is installed as
``ringcore.torch`` and ``bindings/jax`` as ``ringcore.jax`` (see ``setup.py``),
so ``import ringcore`` never imports torch or jax.
"""
