"""Deterministic prompt material for correctness tests: prose, code, lists, dialogue."""

from __future__ import annotations

PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type and an oil-based ink. Books "
    "that had taken scribes months to copy could now be produced in days, and the price of "
    "the written word fell so quickly that literacy spread across Europe within a few "
    "generations. Scholars argue about how much of the Reformation, the scientific "
    "revolution and the rise of newspapers should be credited to this single machine, but "
    "few doubt that it changed how ideas moved between people.",
    "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n"
    "    return out\n\n\nprint(merge_sorted([1, 4, 9], [2, 3, 10, 11]))\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn "
    "light into chemical energy. In the chloroplast, water is split, oxygen is released, and "
    "the energy of sunlight is stored in ATP and NADPH. These carriers then power the Calvin "
    "cycle, which fixes carbon dioxide from the air into sugars. Almost every food chain on "
    "Earth starts with this reaction, and the oxygen we breathe is its by-product.",
    "Shopping list for the weekend trip:\n- two loaves of bread\n- a dozen eggs\n- coffee, "
    "ground, not beans\n- 3 kg of potatoes\n- matches and a lighter\n- sunscreen (SPF 50)\n"
    "- a paper map of the national park, because phones lose signal in the valley\n",
    "User: Can you explain what a hash table is?\nAssistant: A hash table stores key-value "
    "pairs in an array. A hash function turns each key into an index, so looking a key up "
    "takes constant time on average. When two keys land on the same index, the table "
    "resolves the collision, for example by chaining entries in a list or by probing for "
    "the next free slot.\nUser: And when does it get slow?\nAssistant:",
    "Le petit village se trouvait au pied de la montagne. Chaque matin, les habitants "
    "descendaient au marché pour vendre du fromage, du miel et des légumes. En hiver, la "
    "neige bloquait la route pendant des semaines, et les enfants apprenaient à skier avant "
    "de savoir lire.",
    "The committee met on Tuesday to review the budget for the next fiscal year. After a "
    "long discussion about maintenance costs, the members agreed to postpone the new "
    "library wing, increase the funding for road repairs by twelve percent, and hire two "
    "additional staff for the after-school program. The final vote was seven to two.",
    "Mount Everest, known in Nepali as Sagarmatha and in Tibetan as Chomolungma, is Earth's "
    "highest mountain above sea level. Its summit sits on the border between Nepal and "
    "China. Climbers face altitude sickness, extreme weather and strong winds, and most "
    "expeditions rely on supplemental oxygen and the experience of Sherpa guides.",
]


def long_text() -> str:
    """All passages, twice over in a different order: long enough for 1,500 tokens."""
    return "\n\n".join(PASSAGES + PASSAGES[::-1] + PASSAGES[1::2] + PASSAGES[::2])


# Prompt lengths for parity tests: 1 to 1,500 tokens, across block boundaries.
PARITY_LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    13,
    15,
    16,
    17,
    31,
    32,
    33,
    64,
    100,
    150,
    255,
    256,
    300,
    512,
    700,
    1024,
    1500,
]


def parity_prompts(encode) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Token-id prompts of PARITY_LENGTHS, each cut from differently rotated text."""
    prompts = []
    for i, n in enumerate(PARITY_LENGTHS):
        rot = PASSAGES[i % len(PASSAGES) :] + PASSAGES[: i % len(PASSAGES)]
        ids = encode("\n\n".join(rot * 4))
        assert len(ids) >= n, f"corpus too short for {n} tokens"
        prompts.append(ids[:n])
    return prompts
