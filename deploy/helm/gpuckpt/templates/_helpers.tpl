{{/* Names, labels and the paths both containers agree on. */}}

{{- define "gpuckpt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuckpt.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpuckpt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuckpt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpuckpt.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "gpuckpt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
gpuckpt.io/engine: {{ .Values.engine }}
{{- end -}}

{{- define "gpuckpt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpuckpt.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The pool (Deployment adoption) and trust domain of every pod. */}}
{{- define "gpuckpt.pool" -}}
{{- default (include "gpuckpt.fullname" .) .Values.workload.pool -}}
{{- end -}}

{{- define "gpuckpt.workerPort" -}}
{{- if .Values.worker.port -}}{{ int .Values.worker.port }}{{- else if eq .Values.engine "sglang" -}}30000{{- else -}}8000{{- end -}}
{{- end -}}

{{- define "gpuckpt.image" -}}
{{- $what := index . 0 -}}
{{- $img := index . 1 -}}
{{- $repo := required (printf "%s.image.repository: an image is required (docs/kubernetes.md, images)" $what) $img.repository -}}
{{- if $img.digest -}}{{ $repo }}@{{ $img.digest }}{{- else -}}{{ $repo }}:{{ default "latest" $img.tag }}{{- end -}}
{{- end -}}

{{/* Paths. The socket volume and the staging volume are tmpfs (medium: Memory): their root is
sticky like /tmp, so the directories the accounts make in them pass gpuckpt's ownership checks. */}}
{{- define "gpuckpt.runDir" -}}/run/gpuckpt{{- end -}}
{{- define "gpuckpt.agentSocket" -}}/run/gpuckpt/agent/agent.sock{{- end -}}
{{- define "gpuckpt.connectorSocket" -}}/run/gpuckpt/worker/connector.sock{{- end -}}
{{- define "gpuckpt.stagingDir" -}}/dev/shm/gpuckpt-capture{{- end -}}
{{- define "gpuckpt.secretsDir" -}}/var/run/secrets/gpuckpt{{- end -}}

{{/* The grace period: the preStop's checkpoint, the engine's drain, the agent's stop and a margin. */}}
{{- define "gpuckpt.gracePeriod" -}}
{{- $t := .Values.termination -}}
{{- $need := add (int $t.checkpointDeadlineSeconds) (int $t.engineShutdownSeconds) (int $t.agentStopSeconds) (int $t.marginSeconds) -}}
{{- if kindIs "invalid" $t.gracePeriodSeconds -}}{{ $need }}{{- else -}}{{ int $t.gracePeriodSeconds }}{{- end -}}
{{- end -}}

{{/* Values that cannot work together are refused here, naming them. */}}
{{- define "gpuckpt.checks" -}}
{{- $t := .Values.termination -}}
{{- $ckpt := int $t.checkpointDeadlineSeconds -}}
{{- $drain := int $t.engineShutdownSeconds -}}
{{- $stop := int $t.agentStopSeconds -}}
{{- $margin := int $t.marginSeconds -}}
{{- $need := add $ckpt $drain $stop $margin -}}
{{- if and (not (kindIs "invalid" $t.gracePeriodSeconds)) (lt (int $t.gracePeriodSeconds) (int $need)) -}}
{{- fail (printf "termination.gracePeriodSeconds (%d) is less than termination.checkpointDeadlineSeconds (%d) + termination.engineShutdownSeconds (%d) + termination.agentStopSeconds (%d) + termination.marginSeconds (%d) = %d: the final checkpoint or the engine's drain would be cut short; raise it, or leave it null to derive it" (int $t.gracePeriodSeconds) $ckpt $drain $stop $margin (int $need)) -}}
{{- end -}}
{{- if not (kindIs "invalid" $t.nodeShutdownSeconds) -}}
{{- $onNode := add $ckpt $drain $stop -}}
{{- if gt (int $onNode) (int $t.nodeShutdownSeconds) -}}
{{- fail (printf "termination.checkpointDeadlineSeconds (%d) + termination.engineShutdownSeconds (%d) + termination.agentStopSeconds (%d) = %d exceeds termination.nodeShutdownSeconds (%d), what the node gives a pod when it is preempted: shorten them (pre-copy keeps the final checkpoint small: checkpoint.precopyInterval)" $ckpt $drain $stop (int $onNode) (int $t.nodeShutdownSeconds)) -}}
{{- end -}}
{{- end -}}
{{- $s := .Values.staging -}}
{{- $capture := int .Values.checkpoint.maxStagingMiB -}}
{{- $restore := 0 -}}
{{- if not (kindIs "invalid" .Values.restore.maxStagingMiB) -}}{{- $restore = int .Values.restore.maxStagingMiB -}}{{- end -}}
{{- $shm := add $capture $restore (int $s.engineReserveMiB) -}}
{{- if lt (int $s.sizeLimitMiB) (int $shm) -}}
{{- fail (printf "staging.sizeLimitMiB (%d) is less than checkpoint.maxStagingMiB (%d) + restore.maxStagingMiB (%d) + staging.engineReserveMiB (%d) = %d: the agent's staging would not fit in the /dev/shm volume; raise staging.sizeLimitMiB or lower the others" (int $s.sizeLimitMiB) $capture $restore (int $s.engineReserveMiB) (int $shm)) -}}
{{- end -}}
{{- if and (eq .Values.preemption.provider "url") (not .Values.preemption.url) -}}
{{- fail "preemption.provider is url but preemption.url is empty" -}}
{{- end -}}
{{- if and (eq .Values.preemption.provider "file") (not .Values.preemption.file) -}}
{{- fail "preemption.provider is file but preemption.file is empty" -}}
{{- end -}}
{{- $_ := required "repository.url: where the checkpoints go (s3://bucket/prefix?region=…, or a path on a volume) is required" .Values.repository.url -}}
{{- $_ := required "model: the model the worker serves is required" .Values.model -}}
{{- end -}}

{{/* The agent's configuration (agent/daemon/config.py); worker_id comes from the pod's name. */}}
{{- define "gpuckpt.agentConfig" -}}
# gpuckpt agent configuration, rendered by the gpuckpt chart (docs/kubernetes.md).
# worker_id is the pod's name: GPUCKPT_AGENT__WORKER_ID from the downward API.
# No secrets here: the key and the bucket's credentials are files from Secrets mounted into the agent only.
engine = {{ .Values.engine | toJson }}
repository = {{ .Values.repository.url | toJson }}
{{- if .Values.repository.keySecret.name }}
key = {{ printf "file:%s/repository-key/%s" (include "gpuckpt.secretsDir" .) .Values.repository.keySecret.key | toJson }}
{{- end }}
trust_domain = {{ include "gpuckpt.pool" . | toJson }}
{{- if eq .Values.workload.kind "Deployment" }}
pool = {{ include "gpuckpt.pool" . | toJson }}
{{- end }}
connector_socket = {{ include "gpuckpt.connectorSocket" . | toJson }}
staging_dir = {{ include "gpuckpt.stagingDir" . | toJson }}
shared_group = {{ .Values.accounts.sharedGid | int | toString | toJson }}
worker_url = {{ printf "http://127.0.0.1:%s" (include "gpuckpt.workerPort" .) | toJson }}
metrics_address = {{ printf "0.0.0.0:%d" (int .Values.agent.metricsPort) | toJson }}
log_format = {{ .Values.agent.logFormat | toJson }}

[api]
socket = {{ include "gpuckpt.agentSocket" . | toJson }}
mode = "0660"

[checkpoint]
{{- with .Values.checkpoint.interval }}
interval = {{ . | toJson }}
{{- end }}
deadline = {{ .Values.checkpoint.deadline | toJson }}
on_stop = true
stop_deadline = {{ printf "%ds" (int .Values.termination.agentStopSeconds) | toJson }}
{{- if ne .Values.preemption.provider "none" }}
preemption = {{ .Values.preemption.provider | toJson }}
{{- end }}
{{- if eq .Values.preemption.provider "url" }}
preemption_url = {{ .Values.preemption.url | toJson }}
{{- end }}
{{- if eq .Values.preemption.provider "file" }}
preemption_file = {{ .Values.preemption.file | toJson }}
{{- end }}
{{- with .Values.preemption.metadataUrl }}
preemption_metadata_url = {{ . | toJson }}
{{- end }}
{{- with .Values.preemption.poll }}
preemption_poll = {{ . | toJson }}
{{- end }}
canary = {{ .Values.checkpoint.canary }}
{{- with .Values.checkpoint.precopyInterval }}
precopy_interval = {{ . | toJson }}
{{- end }}
max_staging = {{ printf "%dMiB" (int .Values.checkpoint.maxStagingMiB) | toJson }}
copy_per_step = {{ printf "%dMiB" (int .Values.checkpoint.copyPerStepMiB) | toJson }}

[restore]
on_start = {{ .Values.restore.onStart }}
{{- if eq .Values.workload.kind "Deployment" }}
adopt = "claim"
{{- end }}
wait_for_worker = {{ .Values.restore.waitForWorker | toJson }}
require_canary = {{ .Values.restore.requireCanary }}
offer_ttl = {{ .Values.restore.offerTtl | toJson }}
ignore_rules = {{ .Values.restore.ignoreRules | toJson }}
{{- if not (kindIs "invalid" .Values.restore.maxStagingMiB) }}
max_staging = {{ printf "%dMiB" (int .Values.restore.maxStagingMiB) | toJson }}
{{- end }}

[retention]
keep_last = {{ int .Values.retention.keepLast }}
{{- with .Values.retention.keepWithin }}
keep_within = {{ . | toJson }}
{{- end }}
gc_interval = {{ default "0" .Values.retention.gcInterval | toJson }}
{{- end -}}

{{/* The worker's command line: the engine with gpuckpt's adapter, as systemd/*-worker@.service start it. */}}
{{- define "gpuckpt.workerArgs" -}}
{{- $port := include "gpuckpt.workerPort" . -}}
{{- $adapter := dict "control_socket" (include "gpuckpt.connectorSocket" .) "staging_dir" (include "gpuckpt.stagingDir" .) "shared_group" (.Values.accounts.sharedGid | int | toString) -}}
{{- if eq .Values.engine "vllm" }}
- vllm
- serve
- {{ .Values.model | quote }}
- --host
- 0.0.0.0
- --port
- {{ $port | quote }}
- --enable-prefix-caching
- --enable-prompt-tokens-details
- --middleware
- agent.engines.vllm.middleware.GpuckptMiddleware
- --shutdown-timeout
- {{ int .Values.termination.engineShutdownSeconds | toString | quote }}
- --kv-transfer-config
- {{ dict "kv_connector" "GpuckptConnector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $adapter | toJson | quote }}
{{- else }}
- sglang
- serve
- --model-path
- {{ .Values.model | quote }}
- --host
- 0.0.0.0
- --port
- {{ $port | quote }}
- --page-size
- {{ int .Values.worker.sglangPageSize | toString | quote }}
- --enable-unified-cache-external-linker
- --unified-cache-external-linker-backend
- dynamic
- --unified-cache-external-linker-config
- {{ dict "linker" "GpuckptLinker" "linker_module_path" "agent.engines.sglang.linker" "linker_extra_config" $adapter | toJson | quote }}
{{- end }}
{{- range .Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "gpuckpt.containerSecurity" -}}
runAsNonRoot: true
runAsUser: {{ int .uid }}
runAsGroup: {{ int .gid }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .readOnly }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
