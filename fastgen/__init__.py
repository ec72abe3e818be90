"""FastGen: Dynamic SplitFuse LLM serving. The code lives in the top-level folders, installed as fastgen.<folder>."""

__version__ = "0.1.0"
