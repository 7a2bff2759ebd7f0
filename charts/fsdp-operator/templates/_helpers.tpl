{{- define "fsdp-operator.name" -}}fsdp-operator{{- end }}
{{- define "fsdp-operator.fullname" -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}-fsdp-operator{{- end }}
{{- define "fsdp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "fsdp-operator.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end }}
{{- define "fsdp-operator.labels" -}}
app.kubernetes.io/name: {{ include "fsdp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}
{{- define "fsdp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fsdp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
{{- /* The namespaces whose runs the operator handles, comma-separated; empty: every namespace (clusterWide). A
bare install handles its own namespace only: the platform opts namespaces in (watchNamespaces) or the whole cluster
(clusterWide), never the reverse. */}}
{{- define "fsdp-operator.watchNamespaces" -}}
{{- if and .Values.watchNamespaces .Values.clusterWide }}{{ fail "set watchNamespaces or clusterWide, not both" }}{{ end }}
{{- if .Values.watchNamespaces }}{{ join "," .Values.watchNamespaces }}{{ else if not .Values.clusterWide }}{{ .Release.Namespace }}{{ end }}
{{- end }}
