"""The configuration tree (pydantic): a recipe (TOML) plus ``--set`` overrides, validated once.

:mod:`~diloco_async.config.schema` is the tree and the recipe loader; its sections live beside
it: :mod:`~diloco_async.config.model` (the model), :mod:`~diloco_async.config.data` (the
text and its tokenizer), :mod:`~diloco_async.config.guard` (the update guard and the pace
limits); :mod:`~diloco_async.config.tomlfile` reads every TOML file of the project with one
set of error messages. :mod:`~diloco_async.config.resolved` passes the result on as a value: the
``resolved-config.json`` every process of a run reads, typed changes (``with_fields``) and the
synchronous DiLoCo baseline (``synchronous_diloco``). Generated reference: ``docs/reference/config.md``.
"""
