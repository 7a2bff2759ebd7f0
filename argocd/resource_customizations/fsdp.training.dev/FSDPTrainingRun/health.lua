-- Argo CD health check for fsdp.training.dev/FSDPTrainingRun.
-- Runs in the libraries Argo CD opens for a script from argocd-cm (base, table, package, os.time/os.date):
-- no string.* and no math.*, so text is built with `..` and tostring only.
local hs = {}

local function condition(status, type_)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

-- "step 120/1000, loss 2.31, last checkpoint step 100", with only the parts the status has.
local function progress(status)
  local parts = {}
  local p = status.progress or {}
  if p.step ~= nil then
    local step = "step " .. tostring(p.step)
    if p.maxSteps ~= nil then
      step = step .. "/" .. tostring(p.maxSteps)
    end
    table.insert(parts, step)
  end
  if p.loss ~= nil then
    table.insert(parts, "loss " .. tostring(p.loss))
  end
  if p.evalLoss ~= nil then
    table.insert(parts, "eval loss " .. tostring(p.evalLoss))
  end
  local latest = status.checkpoints and status.checkpoints.latest
  if latest ~= nil and latest.step ~= nil then
    table.insert(parts, "last checkpoint step " .. tostring(latest.step))
  end
  return table.concat(parts, ", ")
end

-- The operator's own sentence, then the progress figures once a job of this run has reported any.
local function describe(status, fallback)
  local text = status.message or fallback
  local figures = ""
  if status.attempt ~= nil and status.attempt > 0 then
    figures = progress(status)
  end
  if figures == "" then
    return text
  end
  if text == nil or text == "" then
    return figures
  end
  return text .. " (" .. figures .. ")"
end

local function finished_condition_message(status, type_)
  local c = condition(status, type_)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return nil
end

local status = obj.status
local generation = obj.metadata and obj.metadata.generation
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to accept the run"
  return hs
end
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. tostring(generation)
    .. " (status is of generation " .. tostring(status.observedGeneration) .. ")"
  return hs
end

local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = "Succeeded: " .. progress(status)
  return hs
end
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = describe(status, finished_condition_message(status, "Failed") or "Failed")
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = describe(status, "Suspended")
  return hs
end

-- An active run: Degraded when something is wrong that the run will not fix by itself.
local transport = condition(status, "TransportDegraded")
if transport ~= nil and transport.status == "True" then
  hs.status = "Degraded"
  hs.message = transport.message
  return hs
end
local image = condition(status, "ImageConsistent")
if image ~= nil and image.status == "False" and image.reason == "PodsDisagree" then
  hs.status = "Degraded"
  hs.message = image.message
  return hs
end
local restarts = (status.restarts and status.restarts.count) or 0
local max_restarts = obj.spec and obj.spec.recovery and obj.spec.recovery.maxRestarts
if max_restarts ~= nil and restarts > 0 and restarts >= max_restarts then
  hs.status = "Degraded"
  hs.message = "All " .. tostring(max_restarts) .. " restarts used: the next failure fails the run. "
    .. describe(status, phase)
  return hs
end

hs.status = "Progressing"
local pods = condition(status, "PodsHealthy")
local p = status.progress or {}
if pods ~= nil and pods.status == "False" then
  -- Pods that cannot start (an image that does not pull): the run fails once podErrorTimeoutSeconds pass.
  hs.message = pods.message
elseif phase == "Running" and p.stage ~= nil then
  hs.message = "Setting up (" .. p.stage .. ")"
elseif phase == "Running" and p.step ~= nil then
  hs.message = progress(status)
else
  hs.message = describe(status, phase)
end
return hs
