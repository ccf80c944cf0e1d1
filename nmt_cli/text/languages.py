"""What nmt needs to know about a language, in one table: which codes are Chinese, which are written in CJK
scripts, which without spaces between words, and which right to left."""

from __future__ import annotations

# code -> its properties; Chinese codes other than zh (cmn, yue, wuu) are read as zh.
LANGUAGES = {
    "zh": {"chinese", "cjk", "unspaced"},
    "ja": {"cjk", "unspaced"},
    "ko": {"cjk"},  # written with spaces, but in a CJK script (TER's Asian support, MeCab for BLEU)
    "th": {"unspaced"}, "my": {"unspaced"}, "km": {"unspaced"}, "lo": {"unspaced"},
}
CHINESE_CODES = ("zh", "cmn", "yue", "wuu")
# Written right to left (Arabic, Hebrew and Thaana scripts); iw is Hebrew's old code.
RIGHT_TO_LEFT = ("ar", "arz", "ckb", "dv", "fa", "he", "iw", "ps", "sd", "ug", "ur", "yi")


def base_language(lang: str) -> str:
    """`zh` of zh, zh-TW, zh_Hant or cmn; the language part of a code otherwise."""
    base = lang.lower().replace("_", "-").split("-")[0]
    return "zh" if base in CHINESE_CODES else base


def is_chinese(lang: str) -> bool:
    return "chinese" in LANGUAGES.get(base_language(lang), ())


def is_cjk(lang: str) -> bool:
    """Whether `lang` (an ISO code, maybe with a region: zh-TW) is written in CJK scripts."""
    return "cjk" in LANGUAGES.get(base_language(lang), ())


def is_unspaced(lang: str) -> bool:
    """Whether `lang` is written without spaces between words (words are then counted in characters)."""
    return "unspaced" in LANGUAGES.get(base_language(lang), ())


def is_asian(lang: str) -> bool:
    """CJK or written without spaces: where sacreBLEU's TER needs its Asian support and tokenized BLEU's
    compound splitting means nothing."""
    return base_language(lang) in LANGUAGES


def is_right_to_left(lang: str) -> bool:
    """Whether `lang` is written right to left (a page shows its text with dir="rtl")."""
    return base_language(lang) in RIGHT_TO_LEFT
