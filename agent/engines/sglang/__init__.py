"""The SGLang engine adapter: the linker loaded into the server (:mod:`.linker`), its request ledger
(:mod:`.ledger`) and the serving client (:mod:`.serve`). The modules that run inside SGLang's
processes import it (the linker and its parts, :mod:`.describe`, :mod:`.state`, :mod:`.server`,
:mod:`.middleware`); the agent's side (:mod:`.engine`, :mod:`.serve`, :mod:`.ledger`) never does."""
