"""The engine: LLMEngine (schedule -> execute -> update), model runner, output processing."""


def __getattr__(name: str):
    if name == "LLMEngine":
        from pagellm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
