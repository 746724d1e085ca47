"""The project's one colour per category (STYLE.md), in every figure of every notebook:
each weight's (`WEIGHT_COLOURS`, from its byte family's palette `FAMILY_PALETTES`;
`weight_colour`), the busy lanes and HBM idle by cause (`CATEGORY_COLOURS`,
`IDLE_COLOURS`), a KV tile's fate (`KV_COLOURS`) and `IDLE_GREY` (skipped segments, idle
expert slots). `mk.plots` draws with them and `mk.figure_rules` checks figures against
them. Not here: the figures themselves (`mk.plots`).
"""

from __future__ import annotations

from mk.model.weights import JOINED, names as weight_names

IDLE_GREY = "#c7c7c7"  # skipped segments, idle expert slots

# Each byte family's palette (`mk.model.weights.FAMILIES`): one colour per weight in every figure
# that draws weights (STYLE.md), given to the family's rows of the weight table in table
# order (`WEIGHT_COLOURS`: a weight added to the table needs a colour here, or the import
# fails); "w" (a teaching matrix) is drawn as the first attention weight, a joined weight
# (`mk.model.weights.JOINED`) as its first part.
FAMILY_PALETTES = {
    "embed": ("#7b4173",),
    "attention": ("#1f77b4", "#aec7e8", "#17becf", "#9edae5", "#393b79", "#3182bd",
                  "#6baed6", "#9ecae1", "#c6dbef", "#08519c", "#6b6ecf", "#9c9ede",
                  "#5254a3", "#4292c6"),
    "norms": ("#7f7f7f", "#525252", "#969696", "#636363", "#a5a5a5", "#3f3f3f", "#b5b5b5",
              "#2f2f2f", "#4a4a4a", "#737373", "#8f8f8f", "#bdbdbd", "#d9d9d9", "#595959"),
    "linear": ("#637939", "#8ca252", "#b5cf6b", "#cedb9c", "#8c6d31", "#bd9e39", "#e7ba52",
               "#e7cb94", "#843c39", "#ad494a", "#d6616b", "#e7969c", "#a55194", "#ce6dbd"),
    "dense_mlp": ("#ff7f0e", "#ffbb78", "#d62728", "#e377c2", "#f7b6d2", "#c49c94", "#fdae6b",
                  "#e6550d"),
    "router": ("#bcbd22", "#dbdb8d", "#8c8c17"),
    "experts": ("#2ca02c", "#98df8a", "#8c564b", "#74c476", "#c7e9c0", "#bd9e8b"),
    "lm_head": ("#9467bd",),
}
WEIGHT_COLOURS = {name: FAMILY_PALETTES[family][i] for family in FAMILY_PALETTES
                  for i, name in enumerate(weight_names(family=family))}
WEIGHT_COLOURS["w"] = WEIGHT_COLOURS[weight_names(family="attention")[0]]
WEIGHT_COLOURS |= {joined: WEIGHT_COLOURS[parts[0]] for joined, parts in JOINED.items()}


def weight_colour(name: str) -> str:
    """A weight's colour (`WEIGHT_COLOURS`; "we_gate[3]", an expert slot, is we_gate's)."""
    name = name.split("[")[0]
    if name in WEIGHT_COLOURS:
        return WEIGHT_COLOURS[name]
    palette = sorted(set(WEIGHT_COLOURS.values()))
    return palette[sum(map(ord, name)) % len(palette)]


# One colour per category in every figure (STYLE.md): the busy lanes, then HBM idle by cause.
CATEGORY_COLOURS = {"DMA": "#1f77b4", "MXU": "#ff7f0e", "vector": "#2ca02c",
                    "collective": "#9467bd"}
IDLE_COLOURS = {"step start": "#c7c7c7", "layer boundary": "#d62728", "routing": "#e377c2",
                "attention": "#8c564b", "lm_head": "#bcbd22", "collective": "#c5b0d5",
                "compute": "#ffbb78", "vector": "#98df8a", "ring empty": "#ff9896",
                "step end": "#7f7f7f", "skipped mixer": "#dbdb8d"}
KV_COLOURS = {"read": "#1f77b4", "read and written back": "#ff7f0e",
              "skipped": IDLE_GREY}
