"""One finding of the doctor, and the loaders' errors turned into findings."""
import re
from dataclasses import asdict, dataclass

ERROR, WARNING, INFO = "error", "warning", "info"

# what a loader's message is about -> a short kind (the report counts findings by kind)
KINDS = (
    (r"not valid XML|DOCTYPE or entity|expected <annotation>", "malformed_xml"),
    (r"is not among the classes|is not among the \d+ names", "unknown_class"),
    (r"is outside \[0, 1\]", "coordinate_outside"),
    (r"expected 5 fields|is not an integer|must be finite numbers|expected <bndbox>|<difficult> must be",
     "malformed_label"),
    (r"cannot read image", "unreadable_image"),
    (r"cannot read panoptic PNG|cannot read mask", "unreadable_png"),
    (r"cannot read audio|has no samples", "unreadable_audio"),
    (r"NaN or infinite", "non_finite_audio"),
    (r"decodes to \d+x\d+ but", "size_mismatch"),
    (r"unknown category", "unknown_category"),
    (r"bbox must be", "malformed_box"),
    (r"in the PNG that are not in", "png_id_not_in_json"),
    (r"are not in the PNG", "json_id_not_in_png"),
    (r"mask values", "mask_value"),
    (r"the PNG of image .* is \d+x\d+", "png_size"),
    (r"not among the images", "unknown_image"),
    (r"file not found|PNG not found", "missing_file"),
    (r"rows parsed from", "unbalanced_quote"),
    (r"unknown label", "unknown_label"),
    (r"malformed CSV|empty row|empty text|UTF-8|expected a label", "malformed_row"),
    (r"appears twice|annotated twice", "duplicate_id"),
    (r"not valid JSON|not a .* file", "malformed_json"),
    (r"symlink\(s\) lead", "symlink_loop"),
    (r"symlink\(s\) not followed", "symlink_not_followed"),
)


@dataclass
class Finding:
    check: str           # integrity, stats, leaks, labels
    severity: str        # error, warning, info
    kind: str            # a short code (KINDS, or the check's own)
    message: str         # one line, naming the file and the record, as the loaders' errors do
    file: str = ""
    record: str = ""
    split: str = ""

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if v != ""}


def kind_of(message):
    for pattern, kind in KINDS:
        if re.search(pattern, message):
            return kind
    return "data_error"


def from_error(error, split="", severity=ERROR):
    """A Finding from a loader's DataError / BadSample (their messages start with the file)."""
    message = str(error)
    where = getattr(error, "where", None) or message.split(": ", 1)[0]
    file, _, record = where.partition(", ")
    return Finding("integrity", severity, kind_of(message), message, file=file, record=record, split=split)
