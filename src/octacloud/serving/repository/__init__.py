"""The Triton-layout model repository (:mod:`.repository`) and its config.pbtxt handling (:mod:`.config`).

Import ``ModelRepository`` from :mod:`octacloud.serving` (this package's ``__init__`` stays import-light, as
``octacloud.serving.model`` needs :mod:`.config`)."""
