// Everything of the ddplaunch worker SDK. See docs/worker-sdk.md.
#pragma once

#include "ddp/checkpoint.h"
#include "ddp/crc32c.h"
#include "ddp/ddp.h"
#include "ddp/env.h"
#include "ddp/error.h"
#include "ddp/lineage.h"
#include "ddp/process_group.h"
#include "ddp/progress.h"
#include "ddp/sampler.h"
#include "ddp/trainer.h"
