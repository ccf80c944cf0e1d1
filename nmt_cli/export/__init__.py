"""Other engines' formats: CTranslate2 and Transformers exports, and the choice of engine for a model path. Imports
the root modules, text, model and decode."""
