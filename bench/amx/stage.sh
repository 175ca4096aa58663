#!/usr/bin/env bash
# Copy the folder(s) carried by this device call (.amxA/, .amxB/, ...) into AMX_STAGE (default: the
# temp dir's amx-stage) and say which are still to carry: bench/gpu/stage.sh for the amx family.
# Usage: bash bench/amx/stage.sh [FOLDER...]   (default: every .amx*/ folder present)
PACK=amx exec bash "$(dirname "$0")/../gpu/stage.sh" "$@"
